"""Header parsing, property-tested: valid headers round-trip, anything else is a named error."""

from __future__ import annotations

import gc
import json
import math
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerd.contract import dtypes
from stagerd.contract.safetensors_format import (
    MAX_HEADER_BYTES,
    encode_header,
    parse_dcp_sharding_info,
    parse_header_bytes,
    read_header,
    validate_header,
)
from stagerd.errors import DTypeError, HeaderError

BYTE_DTYPES = [d for d in dtypes.DTYPES.values() if d.bits % 8 == 0]
names = st.text(min_size=1, max_size=12).filter(lambda s: s != "__metadata__")


@st.composite
def tensor_sets(draw):
    """{name: (dtype, shape)} with byte-sized dtypes and small shapes."""
    n = draw(st.integers(0, 6))
    out = {}
    for name in draw(st.lists(names, min_size=n, max_size=n, unique=True)):
        dt = draw(st.sampled_from(BYTE_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        out[name] = (dt.name, shape)
    return out


def build(tensors, metadata=None) -> bytes:
    entries, pos = {}, 0
    for name, (dt, shape) in tensors.items():
        n = dtypes.lookup(dt).nbytes(math.prod(shape))
        entries[name] = (dt, shape, pos, pos + n)
        pos += n
    return encode_header(entries, metadata or {}) + b"\0" * pos


def parse(blob: bytes):
    n, obj = parse_header_bytes("mem", blob, len(blob))
    return validate_header("mem", n, obj, len(blob))


@given(tensor_sets(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_valid_headers_round_trip_and_are_8_aligned(tensors, metadata):
    blob = build(tensors, metadata)
    h = parse(blob)
    assert h.data_start % 8 == 0
    assert h.metadata == metadata
    assert {k: (t.dtype, t.shape) for k, t in h.tensors.items()} == tensors


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(blob):
    try:
        parse(blob)
    except (HeaderError, DTypeError):
        pass


@settings(max_examples=300)
@given(
    tensor_sets().filter(bool),
    st.sampled_from(
        ["dtype", "shape", "offsets", "extra_byte", "missing_key", "reverse", "negative", "float"]
    ),
)
def test_malformed_entries_are_header_errors(tensors, how):
    entries, pos = {}, 0
    for name, (dt, shape) in tensors.items():
        n = dtypes.lookup(dt).nbytes(math.prod(shape))
        entries[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    victim = next(iter(entries.values()))
    data_len = pos
    if how == "dtype":
        victim["dtype"] = "Q7"
    elif how == "shape":
        victim["shape"] = [*victim["shape"], 3] if math.prod(victim["shape"]) else [7]
    elif how == "offsets":
        victim["data_offsets"] = [0, data_len + 1]
    elif how == "extra_byte":
        victim["data_offsets"][1] += 1
    elif how == "missing_key":
        del victim["data_offsets"]
    elif how == "reverse":
        victim["data_offsets"] = [victim["data_offsets"][1] + 1, victim["data_offsets"][0]]
    elif how == "negative":
        victim["data_offsets"] = [-1, victim["data_offsets"][1]]
    else:
        victim["shape"] = [1.5]
    body = json.dumps(entries).encode()
    blob = struct.pack("<Q", len(body)) + body + b"\0" * data_len
    try:
        parse(blob)
    except (HeaderError, DTypeError):
        return
    raise AssertionError(f"accepted a header damaged by {how}")


def test_absurd_length_is_refused_without_allocating(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    try:
        read_header(p)
    except HeaderError as e:
        assert "limit" in str(e)
    else:
        raise AssertionError("accepted")
    p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES - 1) + b"{}")
    try:
        read_header(p)
    except HeaderError as e:
        assert "past the end" in str(e)
    else:
        raise AssertionError("accepted")


def test_a_shape_of_millions_of_dims_is_refused_in_bounded_memory(tmp_path):
    """Before, the entry's pattern kept backtracking state for every dim before the dim count was checked:
    about 475 bytes each, 475 MB for this 2 MB header (23 GiB within the header limit)."""
    import tracemalloc

    p = tmp_path / "dims.safetensors"
    body = b'{"a":{"dtype":"F32","shape":[' + b"1," * 1_000_000 + b'6],"data_offsets":[0,24]}}'
    p.write_bytes(struct.pack("<Q", len(body)) + body + bytes(24))
    tracemalloc.start()
    try:
        with pytest.raises(HeaderError, match="shape must be a list"):
            read_header(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20, peak  # the scanner's list of the dims, a few bytes each past the text


def test_a_dim_too_large_for_any_tensor_is_a_header_error(tmp_path):
    """Before, a `ValueError` from printing the size two 4,000-digit dims need (int's digit limit)."""
    p = tmp_path / "big.safetensors"
    body = b'{"a":{"dtype":"F32","shape":[' + b"9" * 4000 + b"," + b"9" * 4000 + b'],"data_offsets":[0,4]}}'
    p.write_bytes(struct.pack("<Q", len(body)) + body + bytes(4))
    with pytest.raises(HeaderError, match="a shape dim is past 2\\^63 - 1"):
        read_header(p)


def test_deeply_nested_json_is_a_header_error():
    body = b"[" * 100000 + b"]" * 100000
    blob = struct.pack("<Q", len(body)) + body
    try:
        parse(blob)
    except HeaderError:
        return
    raise AssertionError("accepted")


@given(st.lists(st.integers(-3, 5), max_size=4), st.sampled_from(["ok", "not-json", "missing", "extra"]))
def test_dcp_sharding_info_is_validated(offsets, how):
    tensors = {"w": ("F32", (2,) * len(offsets))}
    info = {"w": {"saved_offsets": offsets}}
    if how == "missing":
        info = {}
    elif how == "extra":
        info["ghost"] = {"saved_offsets": []}
    raw = "{" if how == "not-json" else json.dumps(info)
    h = parse(build(tensors, {"DCP_SHARDING_INFO": raw}))
    ok = how == "ok" and all(o >= 0 for o in offsets)
    try:
        assert parse_dcp_sharding_info(h) == {"w": tuple(offsets)}
        assert ok
    except HeaderError:
        assert not ok


def _outcome(read):
    try:
        h = read()
    except (HeaderError, DTypeError) as e:
        return type(e).__name__
    return h.data_start, h.metadata, {k: (t.dtype, t.shape, t.begin, t.end) for k, t in h.tensors.items()}


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensor_sets(),
    st.sampled_from([" ", "\n", "\t", "\r\n "]),
    st.binary(max_size=3),
    st.integers(0, 400),
)
def test_the_streamed_read_agrees_with_the_decoded_header(tmp_path, tensors, ws, junk, at):
    """read_header takes the JSON object's members one at a time: on valid headers, re-spaced ones and
    ones with a few bytes spliced in, it accepts what json.loads and validate_header accept, with the same
    entries, and refuses the rest with a named error."""
    blob = build(tensors, {"format": "pt"})
    n = struct.unpack("<Q", blob[:8])[0]
    body = (
        blob[8 : 8 + n].rstrip().replace(b",", b"," + ws.encode()).replace(b":{", b": " + ws.encode() + b"{")
    )
    at = min(at, len(body))
    body = body[:at] + junk + body[at:]
    blob = struct.pack("<Q", len(body)) + body + blob[8 + n :]
    f = tmp_path / "h.safetensors"
    f.write_bytes(blob)
    want, got = _outcome(lambda: parse(blob)), _outcome(lambda: read_header(f))
    if isinstance(want, str):
        assert isinstance(got, str)
    else:
        assert got == want


def test_a_name_twice_is_refused(tmp_path):
    """json.loads keeps the last of two equal names; the first's bytes would belong to no tensor."""

    def e(b: int) -> str:
        return f'{{"dtype":"F32","shape":[1],"data_offsets":[{b},{b + 4}]}}'

    body = f'{{"a":{e(0)},"a":{e(4)}}}'.encode()
    f = tmp_path / "twice.safetensors"
    f.write_bytes(struct.pack("<Q", len(body)) + body + bytes(8))
    with pytest.raises(HeaderError, match="twice"):
        read_header(f)


def test_read_header_builds_no_tree_of_the_whole_header(tmp_path):
    """Before: json.loads decoded every entry to dicts and lists beside the entries kept (a peak of 3.4x
    what the Header holds, 100 MiB at 100k tensors); now the peak is the Header plus the header's text."""
    n = 3000
    entries = {f"model.layers.{i}.mlp.weight": ("F32", (2, 8), i * 64, (i + 1) * 64) for i in range(n)}
    f = tmp_path / "many.safetensors"
    f.write_bytes(encode_header(entries, {"format": "pt"}) + bytes(n * 64))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        h = read_header(f)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(h.tensors) == n
    assert peak - base < 1.8 * (kept - base), (peak - base, kept - base)


_E = '"dtype":"F32","shape":[2,2],"data_offsets":[0,16]'


@pytest.mark.parametrize(
    "entry",
    [
        f'"w":{{{_E}}}',  # the form every writer uses: one regular-expression match
        ' "w" :\n{ "dtype" : "F32" , "shape" : [ 2 , 2 ] , "data_offsets" : [ 0 , 16 ] } ',
        f'"w\\u0041":{{{_E}}}',  # escapes, a float, another key order or a fourth key: the scanner
        '"w":{"dtype":"F\\u00332","shape":[2,2],"data_offsets":[0,16]}',
        '"w":{"dtype":"F32","shape":[2.0,2],"data_offsets":[0,16]}',
        '"w":{"shape":[2,2],"dtype":"F32","data_offsets":[0,16]}',
        f'"w":{{{_E},"x":1}}',
        '"w":{"dtype":"F32","shape":[02,2],"data_offsets":[0,16]}',  # refused either way
        '"w":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}',
        '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,1' + "0" * 5000 + "]}",
        '"w":{"dtype":"F32","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,4]}',
        '"w":{"dtype":"F33","shape":[2,2],"data_offsets":[0,16]}',
        '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}',
        '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}',
        '"w":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}',
        '"w":{"dtype":"F32","shape":[' + ",".join(["65536"] * 4) + ',0],"data_offsets":[0,0]}',
        '"__metadata__":{' + _E + "}",
        f'"w":{{{_E}}},"v":{{{_E}}}',  # two names at the same bytes
        f'"w":{{{_E}}}}}',  # extra data
    ],
)
def test_each_form_of_an_entry_reads_as_json_loads_reads_it(tmp_path, entry):
    """An entry in the writers' own form is read by one match (`json_members.ENTRY`), any other by the
    stdlib's scanner: either way the outcome is json.loads' with validate_header's checks."""
    body = ("{" + entry + "}").encode()
    blob = struct.pack("<Q", len(body)) + body + bytes(16)
    f = tmp_path / "h.safetensors"
    f.write_bytes(blob)
    want, got = _outcome(lambda: parse(blob)), _outcome(lambda: read_header(f))
    assert got == want
