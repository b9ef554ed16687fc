"""An export made before the in-file order fix (tensors widest first, then in natural order, instead of
safetensors' writer order) holds the right bytes in another layout: `verify --against` passes it and says
so once; any other difference still fails, and names what differs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stagerd.contract import dtypes
from stagerd.contract.safetensors_format import encode_header, read_header
from stagerd.contract.sharding import natural_key
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.verify import verify_export
from stagerd.errors import VerifyError
from tests.cli_helpers import run_cli


def rewrite(path: Path, key, change=None) -> None:
    """Lay `path`'s tensors out again, sorted by `key(name, dtype)`: the same tensors and bytes, as the
    planner before the order fix wrote them (`old_key`). `change(entries)` may alter the header after."""
    h = read_header(path)
    raw = path.read_bytes()
    entries, blobs, pos = {}, [], 0
    for t in sorted(h.tensors.values(), key=lambda t: key(t.name, t.dtype)):
        entries[t.name] = (t.dtype, t.shape, pos, pos + t.nbytes)
        blobs.append(raw[h.data_start + t.begin : h.data_start + t.end])
        pos += t.nbytes
    if change is not None:
        change(entries)
    path.write_bytes(encode_header(entries, {"format": "pt"}) + b"".join(blobs))


def old_key(name: str, dtype: str) -> tuple:
    return (-dtypes.lookup(dtype).bits, natural_key(name))


@pytest.fixture(scope="module")
def current(dcp_mixed, tmp_path_factory) -> tuple[Path, Path]:
    """A sharded export of the mixed checkpoint, as this stagerd writes it."""
    src, _ = dcp_mixed
    out = tmp_path_factory.mktemp("current") / "export"
    out.mkdir()
    consolidate_into(src, out, max_shard_size=2048)
    return src, out


@pytest.fixture
def old(current, tmp_path) -> tuple[Path, Path]:
    src, out = current
    old = tmp_path / "old"
    shutil.copytree(out, old)
    for f in sorted(old.glob("model-*.safetensors")):
        rewrite(f, old_key)
    return src, old


def test_the_fixture_is_an_old_order_export(current, old):
    """The rewrite really changes the layout of some files (else the tests below prove nothing)."""
    (_, new), (_, was) = current, old
    changed = [
        f.name for f in sorted(new.glob("*.safetensors")) if f.read_bytes() != (was / f.name).read_bytes()
    ]
    assert len(changed) >= 2, changed


def test_an_old_order_export_verifies_against_its_source(old):
    """Before: "header differs from the one the source gives". Now: every byte is checked in the
    export's own layout, and the report names the files laid out in the older order."""
    src, out = old
    r = verify_export(out, src)
    assert r.compared_with == src
    assert r.older_order and all(n.startswith("model-") for n in r.older_order)
    assert verify_export(out).older_order == r.older_order  # seen without a source too


def test_a_current_export_is_not_older(current):
    src, out = current
    assert verify_export(out, src).older_order == ()


def test_a_wrong_byte_in_an_old_order_export_still_fails(old):
    src, out = old
    f = max(out.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(VerifyError) as e:
        verify_export(out, src)
    assert e.value.path == str(f), e.value


def test_an_old_order_export_with_a_wrong_shape_names_the_tensor(old):
    """Same bytes, but one tensor's shape transposed: not an order difference, and the message says which."""
    src, out = old

    def transpose(entries):
        name, (dt, shape, b, e) = next(
            (n, v) for n, v in entries.items() if len(v[1]) == 2 and v[1][0] != v[1][1]
        )
        entries[name] = (dt, shape[::-1], b, e)

    f = next(
        out / name
        for name in verify_export(out).older_order
        if any(len(set(t.shape)) == 2 for t in read_header(out / name).tensors.values())
    )
    rewrite(f, old_key, transpose)
    with pytest.raises(VerifyError, match="shape") as e:
        verify_export(out, src)
    assert e.value.path == str(f)


def test_a_header_listing_tensors_out_of_data_order_still_fails(current, tmp_path):
    """The header's entries in another order than the data: not what any stagerd wrote."""
    src, new = current
    out = tmp_path / "out"
    shutil.copytree(new, out)
    f = max(out.glob("model-*.safetensors"), key=lambda f: len(read_header(f).tensors))
    h = read_header(f)
    raw = f.read_bytes()
    entries = {t.name: (t.dtype, t.shape, t.begin, t.end) for t in reversed(list(h.tensors.values()))}
    head = encode_header(entries, {"format": "pt"})
    assert len(head) == h.data_start
    f.write_bytes(head + raw[h.data_start :])
    with pytest.raises(VerifyError, match="header"):
        verify_export(out, src)


def test_cli_says_it_once(old):
    src, out = old
    proc = run_cli(["verify", out, "--against", src])
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "older stagerd" in ln]
    assert len(notes) == 1 and "save_pretrained" in notes[0], proc.stdout + proc.stderr


def test_a_current_export_with_a_wrong_shape_names_the_tensor_and_both_shapes(current, tmp_path):
    """In the writer's own order one tensor's shape transposed (same bytes): before, only "header
    differs"; now the message names the tensor, both shapes, and the hint says what to do."""
    src, new = current
    out = tmp_path / "out"
    shutil.copytree(new, out)
    changed = {}

    def transpose(entries):
        name, (dt, shape, b, e) = next(
            (n, v) for n, v in entries.items() if len(v[1]) == 2 and v[1][0] != v[1][1]
        )
        entries[name] = (dt, shape[::-1], b, e)
        changed.update(name=name, shape=list(shape))

    f = next(
        f
        for f in sorted(out.glob("model-*.safetensors"))
        if any(len(set(t.shape)) == 2 for t in read_header(f).tensors.values())
    )
    rewrite(f, lambda name, dtype: (-dtypes.writer_rank(dtype), name), transpose)
    with pytest.raises(VerifyError) as e:
        verify_export(out, src)
    msg = e.value.message
    name, shape = changed["name"], changed["shape"]
    assert e.value.path == str(f)
    assert repr(name) in msg and str(shape[::-1]) in msg and str(shape) in msg, msg
    assert "\n" not in msg and "consolidate" in e.value.hint
