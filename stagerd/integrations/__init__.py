"""The trainers people use, saving through the `Stager`: `transformers.StagerdCallback` for the Hugging
Face Trainer (and TRL's trainers, which are Trainers), `lightning.StagerdCheckpointIO` for Lightning.
Each module imports its trainer library only when used."""
