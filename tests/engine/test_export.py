"""export_step's result describes the export as written, so callers need not read it back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.engine.export import export_step, list_files
from stagerd.errors import SymlinkError
from tests.export_index import export_index


def test_export_result_matches_the_directory(step_dir):
    res = export_step(step_dir, dtype="bf16")
    final = step_dir / layout.EXPORT_DIR
    assert res.export_dir == final and not res.skipped and res.seconds > 0
    assert res.files == list_files(final)
    index = export_index(final)
    assert res.tensor_bytes == index["metadata"]["total_size"]
    assert res.tensors == len(index["weight_map"])
    again = export_step(step_dir, dtype="bf16")
    assert again.skipped and again.files == res.files and again.tensors == res.tensors


def test_a_killed_merges_scratch_is_removed_by_the_next_export(step_dir):
    # A LoRA merge's scratch lives beside export.tmp/; kill -9 leaves it, and nothing else would remove it.
    scratch = step_dir / ".stagerd-merge-abc123"
    scratch.mkdir()
    (scratch / "merged.safetensors").write_bytes(b"\0" * 4096)
    (step_dir / layout.EXPORT_TMP_DIR).mkdir()

    export_step(step_dir)

    assert not scratch.exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()
    assert (step_dir / layout.EXPORT_DIR / layout.WEIGHTS_NAME).is_file()


def _victim(step_dir: Path, d: Path) -> dict[str, bytes]:
    """Another step's directory (the same save, its export being built, and an older one): what a link may
    lead to, and every file it holds."""
    shutil.copytree(step_dir, d)
    for part in (layout.EXPORT_TMP_DIR, layout.EXPORT_DIR):
        (d / part).mkdir()
        (d / part / layout.WEIGHTS_NAME).write_bytes(b"not this step's")
    return _tree(d)


def _refusal(step_dir: Path) -> BaseException | None:
    try:
        export_step(step_dir)
    except Exception as e:
        return e
    return None


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _swap(path: Path, aside: Path, target: Path) -> None:
    """What moving a directory to another disk and linking it back does, at one instant."""
    path.rename(aside)
    path.symlink_to(target, target_is_directory=True)


def test_a_step_linked_away_before_its_export_is_prepared_is_refused(step_dir, tmp_path, monkeypatch):
    """The step swapped for a link after it was checked, before export.tmp/ and export/ are cleared: the
    export removed the export.tmp/ and export/ where the link led and built its own there. Now: a
    SymlinkError naming the step, nothing where the link leads touched."""
    from stagerd.engine import source as source_mod

    victim = tmp_path / "victim"
    before = _victim(step_dir, victim)
    reference = source_mod.Source.reference

    def swap_then_read(self: source_mod.Source) -> object:
        _swap(step_dir, tmp_path / "aside", victim)
        return reference(self)

    monkeypatch.setattr(source_mod.Source, "reference", swap_then_read)
    e = _refusal(step_dir)
    assert _tree(victim) == before
    assert isinstance(e, SymlinkError) and e.path == str(step_dir) and "/proc/" not in str(e)


@pytest.mark.parametrize("part", [".", layout.EXPORT_TMP_DIR])
def test_a_directory_linked_away_mid_export_leads_no_write_elsewhere(step_dir, tmp_path, monkeypatch, part):
    """The step (or its export.tmp/) swapped for a link while the export is built: the shards were written
    into, and export.tmp/ renamed to export/ in, the directory the link led to. Now the files go into the
    directory the export holds open, nothing is committed (a SymlinkError naming the link), what was built
    is removed, and nothing where the link leads is touched."""
    from stagerd.engine import export as export_mod

    victim, aside = tmp_path / "victim", tmp_path / "aside"
    before = _victim(step_dir, victim)
    swapped = (step_dir / part).resolve()
    consolidate = export_mod.consolidate_into

    def swap_then_write(*args: object, **kwargs: object) -> object:
        _swap(swapped, aside, victim)
        return consolidate(*args, **kwargs)

    monkeypatch.setattr(export_mod, "consolidate_into", swap_then_write)
    e = _refusal(step_dir)
    assert _tree(victim) == before
    assert isinstance(e, SymlinkError) and e.path == str(swapped) and "/proc/" not in str(e)
    if part == ".":  # the step's own directory, moved: nothing committed in it, what was built removed
        assert not (aside / layout.EXPORT_DIR).exists() and not (aside / layout.EXPORT_TMP_DIR).exists()
    else:  # the export.tmp/ the export held, moved: emptied; the link is left to the user
        assert not list(aside.iterdir()) and not (step_dir / layout.EXPORT_DIR).exists()
        assert (step_dir / layout.EXPORT_TMP_DIR).is_symlink()


def test_an_error_read_through_the_held_step_names_its_real_path(step_dir):
    """The export reads the step through /proc/self/fd/N; its errors still name the step's own path
    (guard: by-path reads named it before)."""
    from stagerd.errors import ExtrasError

    config = step_dir / "extras" / "config.json"
    config.write_text("[" + " " * (config.stat().st_size - 3) + "]\n")  # the size the marker lists
    with pytest.raises(ExtrasError) as e:
        export_step(step_dir)
    assert e.value.path == str(config) and "/proc/" not in str(e.value)
    assert not (step_dir / layout.EXPORT_TMP_DIR).exists()


def _another_save(model: Path, d: Path) -> None:
    """Another save of the same tensors, shapes and file sizes (each shard's first data bytes changed):
    every check by size, header and plan passes on it."""
    shutil.copytree(model, d)
    for shard in d.glob("*.safetensors"):
        data = bytearray(shard.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[start : start + 64] = bytes(b ^ 0x5A for b in data[start : start + 64])
        shard.write_bytes(bytes(data))


def _reference_export(step_dir: Path, tmp_path: Path) -> dict[str, bytes]:
    ref = tmp_path / "reference" / step_dir.name
    shutil.copytree(step_dir, ref)
    export_step(ref)
    return _tree(ref / layout.EXPORT_DIR)


@pytest.mark.parametrize("part", [layout.MODEL_DIR, layout.EXTRAS_DIR, "shard"])
def test_inputs_linked_away_mid_export_are_not_read(step_dir, tmp_path, monkeypatch, part):
    """The step's model/ (or extras/, or one shard) swapped for a link to another save of the same shapes
    after the step was checked, before its bytes are read: the export read, and would have published,
    the other save's bytes. Now the export reads the directories and files it opened when it checked them."""
    from stagerd.engine import consolidate as consolidate_mod
    from stagerd.engine import export as export_mod

    want = _reference_export(step_dir, tmp_path)
    other = tmp_path / "other"
    _another_save(step_dir / layout.MODEL_DIR, other / layout.MODEL_DIR)
    shutil.copytree(step_dir / layout.EXTRAS_DIR, other / layout.EXTRAS_DIR)
    (other / layout.EXTRAS_DIR / "tokenizer.json").write_text('{"version": "6.6"}\n')  # same size
    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[0].relative_to(step_dir)
    swapped = shard if part == "shard" else Path(part)
    # A shard is read by name when the plan's files are opened; the directories' files before that.
    mod, name = (consolidate_mod, "execute") if part == "shard" else (export_mod, "consolidate_into")
    call = getattr(mod, name)

    def swap_then_read(*args: object, **kwargs: object) -> object:
        (step_dir / swapped).rename(tmp_path / "aside")
        (step_dir / swapped).symlink_to(other / swapped, target_is_directory=part != "shard")
        return call(*args, **kwargs)

    monkeypatch.setattr(mod, name, swap_then_read)
    export_step(step_dir)
    assert _tree(step_dir / layout.EXPORT_DIR) == want


@pytest.mark.parametrize("part", [layout.MODEL_DIR, layout.EXTRAS_DIR, "shard"])
def test_a_link_in_place_of_an_input_is_a_symlink_error(step_dir, tmp_path, part):
    """model/, extras/ or a shard that is a link (here to a copy inside the step, which passes the marker's
    checks) when the export opens it: a SymlinkError naming it, nothing written."""
    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[0].relative_to(step_dir)
    linked = step_dir / (shard if part == "shard" else part)
    copy = step_dir / "copy"
    (shutil.copy2 if part == "shard" else shutil.copytree)(linked, copy)
    (shutil.rmtree if part != "shard" else Path.unlink)(linked)
    linked.symlink_to(copy, target_is_directory=part != "shard")
    with pytest.raises(SymlinkError) as e:
        export_step(step_dir)
    assert e.value.path == str(linked) and "/proc/" not in str(e.value) and e.value.hint
    assert len(str(e.value).splitlines()) == 1
    assert not (step_dir / layout.EXPORT_DIR).exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()
