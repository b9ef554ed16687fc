"""The generated model card, a public README on the Hub, never holds a token from the run metadata.

`Stager.save(metadata=...)` feeds the card's "Run metadata" table, every value rendered as given: a trainer's
arguments (`vars(args)`, whose `hub_token` the HF Trainer has) or a command line with `--token`. Before, the
token went into the README of the step's commit, readable by anyone who can read the repo and kept in its
history. An OAuth token (`hf_oauth_...`, a Space's login) was not recognised as one at all.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import hf_hub_download

from tests.sinks.hub.hub_helpers import REPO, make_sink, one_file_export


def test_a_token_in_the_run_metadata_is_masked_in_the_card(hub, tmp_path):
    metadata = {
        "args": {"hub_token": hub.token, "learning_rate": 3e-4},
        "command": f"train.py --push --token {hub.token}",
        "space_login": "hf_oauth_0123456789abcdefghij",  # a Space's OAuth token, not the sink's
        "run": "sft-7",
    }

    make_sink(hub).publish(one_file_export(tmp_path, 1), 1, metadata=metadata)

    card = Path(
        hf_hub_download(
            REPO,
            "README.md",
            revision="step-1",
            endpoint=hub.endpoint,
            token=hub.token,
            cache_dir=tmp_path / "c",
        )
    ).read_text()
    assert hub.token not in card and "0123456789abcdefghij" not in card
    assert "sft-7" in card and "learning_rate" in card and "train.py --push --token ***" in card
