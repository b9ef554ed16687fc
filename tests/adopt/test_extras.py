"""The extras of an adopted checkpoint (config.json, the tokenizer) are read only from files the trainer
wrote: the daemon often runs as another, more privileged user, so a link in the checkpoint or beside it
(`tokenizer.model -> /root/.ssh/id_ed25519`) would have it publish what the trainer cannot read. The
operator's `--extras DIR` is followed, links and all: a Hugging Face cache snapshot is links into blobs/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.adopt import ranks
from tests.adopt.helpers import published, watch_once
from tests.cli_helpers import run_cli

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- only the daemon's user may read this\n"


def _holds_secret(tree: Path) -> list[Path]:
    return [p for p in tree.rglob("*") if p.is_file() and SECRET in p.read_bytes()]


def test_a_linked_extra_in_the_checkpoint_or_beside_it_is_never_published(tmp_path):
    """step-1 takes `tokenizer.model` from ROOT, where it is a link to a private file; step-3 has a
    `tokenizer.json` that is one. Both were exported and published, the private file in them. Now each is
    a SymlinkError naming the link, quarantined; step-2 (its own files, and the operator's --extras, an HF
    cache snapshot of links) is published."""
    root, sink, snap = tmp_path / "root", tmp_path / "out", tmp_path / "hub" / "snapshots" / "abc"
    secret = tmp_path / "id_ed25519"
    secret.write_bytes(SECRET)
    ranks.write(str(root / "step-1"))
    for n in (2, 3):
        shutil.copytree(root / "step-1", root / f"step-{n}")
        (root / f"step-{n}" / "tokenizer.model").write_bytes(b"sentencepiece")
    (root / "tokenizer.model").symlink_to(secret)
    (root / "step-3" / "tokenizer.json").symlink_to(secret)
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "0a1b").write_text('{"model_max_length": 16}')
    (snap / "tokenizer_config.json").symlink_to(Path("..", "..", "blobs", "0a1b"))

    res = watch_once(root, sink, "--extras", str(snap))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "1 step(s) published, 2 not" in res.stdout, out
    assert f"{root / 'tokenizer.model'}: is a symbolic link" in out, out
    assert f"{root / 'step-3' / 'tokenizer.json'}: is a symbolic link" in out, out
    two = published(sink, 2)
    assert (two / "tokenizer.model").read_bytes() == b"sentencepiece"
    assert (two / "tokenizer_config.json").read_text() == '{"model_max_length": 16}'
    assert not published(sink, 1).exists() and not published(sink, 3).exists()
    assert _holds_secret(sink) == [] and _holds_secret(root / ".stagerd") == []
    status = run_cli(["status", root]).stdout
    rows = {r[0]: r for r in (ln.split() for ln in status.splitlines()) if r[1:2] == ["quarantined"]}
    assert sorted(rows) == ["1", "3"] and all("SymlinkError:" in rows[s] for s in rows), status


def test_an_extra_linked_away_while_it_is_copied_is_not_what_is_exported(tmp_path, monkeypatch):
    """The checkpoint's `tokenizer.json` swapped for a link to a private file after it was found, before it
    is copied, and put back before the check that the checkpoint held still: the copy read the private
    file, every stat matched again, and it was exported. Now the extra is read through the file opened
    when it was found: the checkpoint's own bytes."""
    from stagerd.engine import export as export_mod
    from stagerd.engine.adopt.export import export_adopted

    ckpt, secret = tmp_path / "step-1", tmp_path / "id_ed25519"
    secret.write_bytes(SECRET)
    ranks.write(str(ckpt))
    tok = ckpt / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    (ckpt / "vocab.json").write_text("{}")
    crash_point, calls = export_mod.crash_point, []

    def swap(name: str) -> None:
        if name == "export.extra":
            calls.append(name)
            if len(calls) == 1:  # before tokenizer.json is copied
                tok.rename(tmp_path / "aside")
                tok.symlink_to(secret)
            elif len(calls) == 2:  # before vocab.json: put back, the same inode and mtime
                tok.unlink()
                (tmp_path / "aside").rename(tok)
        crash_point(name)

    monkeypatch.setattr(export_mod, "crash_point", swap)
    r = export_adopted(ckpt, tmp_path / "work")
    assert len(calls) == 2
    assert (r.export_dir / "tokenizer.json").read_text() == '{"version": "1.0"}'


@pytest.mark.parametrize("where", ["checkpoint", "parent"])
def test_a_linked_extra_is_a_one_line_symlink_error(tmp_path, where):
    from stagerd.engine.adopt.export import export_adopted
    from stagerd.errors import SymlinkError

    ckpt, secret = tmp_path / "step-1", tmp_path / "id_ed25519"
    secret.write_bytes(SECRET)
    ranks.write(str(ckpt))
    link = (ckpt if where == "checkpoint" else tmp_path) / "config.json"
    link.symlink_to(secret)
    with pytest.raises(SymlinkError) as e:
        export_adopted(ckpt, tmp_path / "work")
    msg = str(e.value)
    assert e.value.path == str(link) and len(msg.splitlines()) == 1 and "/proc/" not in msg, msg
    assert "--extras" in (e.value.hint or ""), e.value.hint
    assert not (tmp_path / "work" / "export").exists()


def test_each_extra_comes_from_the_checkpoint_then_extras_dir_then_root(tmp_path):
    root, extras, sink = tmp_path / "root", tmp_path / "extras", tmp_path / "out"
    ranks.write(str(root / "step-1"))
    extras.mkdir()
    places = {"vocab.json": (root / "step-1", extras, root), "merges.txt": (extras, root)}
    places["chat_template.jinja"] = (root,)
    for name, dirs in places.items():
        for d in dirs:
            (d / name).write_text(f"{name} from {d.name}")
    res = watch_once(root, sink, "--extras", str(extras))
    assert "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr
    for name, dirs in places.items():
        assert (published(sink, 1) / name).read_text() == f"{name} from {dirs[0].name}", name


@pytest.mark.parametrize("name", ["step-1", "step-00000001"])
def test_a_quarantined_checkpoint_is_retried_once_its_cause_is_fixed(tmp_path, name):
    """What the quarantine line says to do: fix the cause, `stagerd retry ROOT`, and the next watch
    exports the trainer's checkpoint again (it has no stagerd marker: it is there while its directory is),
    named as the Stager names its steps too."""
    root, sink, secret = tmp_path / "root", tmp_path / "out", tmp_path / "id_ed25519"
    secret.write_bytes(SECRET)
    ranks.write(str(root / name))
    (root / "tokenizer.model").symlink_to(secret)
    res = watch_once(root, sink)
    assert "0 step(s) published, 1 not" in res.stdout and "stagerd retry" in res.stdout, res.stdout
    (root / "tokenizer.model").unlink()
    (root / "tokenizer.model").write_bytes(b"sentencepiece")
    retry = run_cli(["retry", root])
    assert retry.returncode == 0 and "re-armed" in retry.stdout, retry.stdout + retry.stderr
    res = watch_once(root, sink)
    assert "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr
    assert (published(sink, 1) / "tokenizer.model").read_bytes() == b"sentencepiece"


def test_extras_given_after_an_export_reach_the_sink_that_lacks_the_step(tmp_path):
    """Published without a config.json (the warning said to pass --extras DIR), then given it: a sink
    that lacks the step got the export built before, no config.json and nothing said. It now gets the
    step rebuilt with the extras, its weights the same bytes; the first sink keeps its copy."""
    root, extras, first, second = tmp_path / "root", tmp_path / "extras", tmp_path / "a", tmp_path / "b"
    ranks.write(str(root / "step-1"))
    res = watch_once(root, first)
    assert "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr
    assert not (published(first, 1) / "config.json").exists()
    extras.mkdir()
    (extras / "config.json").write_text('{"model_type": "llama"}')
    res = watch_once(root, second, "--extras", str(extras))
    assert "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr
    assert json.loads((published(second, 1) / "config.json").read_text())["model_type"] == "llama"
    weights = [(published(sink, 1) / "model.safetensors").read_bytes() for sink in (first, second)]
    assert weights[0] == weights[1]
    assert not (published(first, 1) / "config.json").exists()
