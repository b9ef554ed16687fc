"""The parts of `bench/bench_goodput.py`, one job each.

- `model`: the Llama presets, building the model and optimizer, one training step;
- `methods`: the save methods compared, each behind one small interface;
- `loop`: a run of K-step save windows, and the no-save windows adjacent to each run;
- `daemon`: `stagerd watch` beside the loop, what it is doing when, and waiting for its backlog;
- `disk`: the disk's sequential-write floor;
- `split`: the stagerd run's steps while the daemon works against while it is idle;
- `report`: the markdown tables, from the raw figures `--json` keeps.
"""
