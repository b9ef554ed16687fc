"""A person's files on the branch a sink publishes to: a LICENSE, a `.gitignore`, a hand-written model card.
Each step's commit leaves them as they are and deletes only what the Hub says stagerd wrote (an earlier
step's shard or extra), and weights a loader would read in place of the export's, whoever wrote them.
Before, every step's commit deleted whatever the export lacked, the person's files with it.

Against the Hub-protocol test server, driven by the real huggingface_hub client (`list_repo_tree`'s
`expand`: each file's last commit)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from stagerd.sinks.hub import step_tag
from tests.sinks.hub.hub_helpers import (  # noqa: F401  (fixtures)
    REPO,
    default_hub_config,
    lfs_only,
    make_sink,
    write_export,
)

THEIRS = {
    "LICENSE": b"Apache-2.0\n",
    ".gitignore": b"*.tmp\n",
    "README.md": b"# our run\n\nwritten by hand\n",
    "docs/notes.md": b"what we tried\n",
}


def _tree(api: HfApi, rev: str) -> dict[str, str]:
    """path -> git blob id of the files at `rev`."""
    return {
        f.path: f.blob_id
        for f in api.list_repo_tree(REPO, revision=rev, recursive=True)
        if hasattr(f, "size")
    }


def test_a_persons_files_stay_and_stale_weights_and_stagerds_own_files_go(hub, tmp_path: Path):
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_repo(REPO)
    ops = [CommitOperationAdd(p, b) for p, b in THEIRS.items()]
    ops.append(CommitOperationAdd("pytorch_model.bin", b"an older model's weights"))
    api.create_commit(REPO, ops, commit_message="our files")
    theirs = {p: b for p, b in _tree(api, "main").items() if p in THEIRS}

    one = write_export(tmp_path / "one", seed=1, shards=1)
    (one / "tokenizer.json").write_text("{}")  # an extra of this step only
    make_sink(hub).publish(one, 1)

    step1 = _tree(api, step_tag(1))
    assert {p: step1.get(p) for p in THEIRS} == theirs  # kept byte for byte: their card is not replaced
    assert "pytorch_model.bin" not in step1  # loaded in place of the export's: deleted
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(step1)

    two = write_export(tmp_path / "two", seed=2, shards=2)
    make_sink(hub).publish(two, 2)

    step2 = _tree(api, step_tag(2))
    assert {p: step2.get(p) for p in THEIRS} == theirs
    # step 1's single file (it would be read before step 2's index) and its extra: stagerd's, deleted
    assert "model.safetensors" not in step2 and "tokenizer.json" not in step2
    assert set(step2) - set(THEIRS) == {
        ".gitattributes",
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }

    # published again (a daemon's retry after a crash): the step is found whole beside the person's files
    assert make_sink(hub).publish(two, 2).skipped


def test_a_card_stagerd_wrote_is_replaced_and_one_a_person_edited_is_kept(hub, tmp_path: Path):
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    make_sink(hub).publish(write_export(tmp_path / "one", seed=1, shards=1), 1, metadata={"run": "a"})
    card1 = api.hf_hub_download(REPO, "README.md", revision=step_tag(1), cache_dir=tmp_path / "c1")
    assert "stagerd" in Path(card1).read_text()

    make_sink(hub).publish(write_export(tmp_path / "two", seed=2, shards=1), 2, metadata={"run": "b"})
    card2 = _tree(api, step_tag(2))["README.md"]
    assert card2 != _tree(api, step_tag(1))["README.md"]  # stagerd's own card: written for each step

    api.create_commit(REPO, [CommitOperationAdd("README.md", b"# edited\n")], commit_message="edit card")
    edited = _tree(api, "main")["README.md"]
    make_sink(hub).publish(write_export(tmp_path / "three", seed=3, shards=1), 3, metadata={"run": "c"})
    assert _tree(api, step_tag(3))["README.md"] == edited


def test_what_a_loader_would_read_instead_depends_on_whether_the_export_is_an_adapter(hub, tmp_path: Path):
    """An adapter's config beside a model's export makes `from_pretrained` load the adapter's base instead:
    deleted. A model's weights beside an adapter's export (the repo also holds its base) are not read in
    its place: kept."""
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_repo(REPO)
    person = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"an old adapter", "LICENSE": b"MIT"}
    api.create_commit(REPO, [CommitOperationAdd(p, b) for p, b in person.items()], commit_message="ours")
    make_sink(hub).publish(write_export(tmp_path / "model", seed=1, shards=1), 1)
    step1 = _tree(api, step_tag(1))
    assert "adapter_config.json" not in step1 and "adapter_model.safetensors" not in step1
    assert "LICENSE" in step1

    api.create_commit(
        REPO, [CommitOperationAdd("model.safetensors", b"the base, by hand")], commit_message="base weights"
    )
    base = _tree(api, "main")["model.safetensors"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(
        (tmp_path / "model" / "model.safetensors").read_bytes()
    )
    make_sink(hub).publish(adapter, 2)
    step2 = _tree(api, step_tag(2))
    assert step2["model.safetensors"] == base and "config.json" not in step2  # config.json: step 1's, gone
