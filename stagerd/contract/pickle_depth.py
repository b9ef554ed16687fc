"""How deeply a pickle nests its values, found by reading its opcodes before anything is unpickled.

An allowlist decides which globals a pickle may name, not what shape its plain values take. A tuple nested a
million deep costs one byte per level, and CPython 3.11 hashes a tuple by recursing in C with no depth
check: the unpickler hashes every dict key and set element, so such a key kills the process (SIGSEGV)
whatever the allowlist says (torch's weights-only unpickler too). Every value gets a depth here, one more
than the deepest value it was built from or given (a list by APPEND, a record by BUILD); a pickle whose
depth passes `MAX_DEPTH` is refused before it is loaded. The depth of a value is kept where the memo refers
to it, so a value fetched again is as deep as it has grown. A value that grows after it was put inside
another is refused: its holders were counted when it was shallower, and records hashed by a Python
`__hash__` (frozen dataclasses) chain such hidden depth past any bound but the recursion limit. Only a
cycle does that in a pickle a pickler wrote. Callers also never repr or str such values unbounded (`show`).

The scan moves the stack as CPython's C unpickler does: a MARK fences the values below it, POP drops a MARK
on top, FRAME only chunks the stream, memo keys are what the unpickler reads. It decodes no argument beyond
its length (the unpickler refuses bad UTF-8 or escapes itself), and refuses a memo key greater than the
count of values memoized before it: picklers number them 0, 1, 2..., and the unpickler sizes its memo
array by the key (a 9-byte pickle storing at key 2^26 took 1 GiB to load). `_pickle_depth.c` runs this
scan in C from the same table (0.15 s for the 22 MB `.metadata` of 102,400 chunks, 4% of its unpickle;
7 s here); without a C compiler at install, `scan_py` runs, with the same verdicts.
"""

from __future__ import annotations

import pickletools
import reprlib

try:
    from stagerd.contract import _pickle_depth
except ImportError:  # built without a C compiler: the same scan in Python
    _pickle_depth = None  # type: ignore[assignment]

MAX_DEPTH = 100  # DCP's metadata and torch.save records nest under 10
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 3, 60, 60

# Verdicts, as (verdict, byte offset of the opcode, detail), the same from the C scan and `scan_py`.
OK, TOO_DEEP, TRUNCATED, UNKNOWN_OPCODE, UNDERFLOW, NO_MARK = range(6)
BAD_KEY, KEY_AHEAD, NOT_STORED, NEGATIVE, GROWS_INSIDE = range(6, 11)
# What follows an opcode: nothing, `size` bytes, a line, two lines, a length of 1, 4 (signed), 4 or 8 bytes
# then that many bytes.
_K_NONE, _K_FIXED, _K_LINE, _K_TWO_LINES, _K_LEN1, _K_LEN4S, _K_LEN4U, _K_LEN8U = range(8)
_K_UNKNOWN = 255
# What an opcode does to the stack.
_A_BUILD, _A_MUTATE, _A_MARK, _A_PUT, _A_GET, _A_DUP, _A_POP, _A_STOP = range(8)
_MUTATES = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_ACTIONS = {"MARK": _A_MARK, "DUP": _A_DUP, "POP": _A_POP, "STOP": _A_STOP, "MEMOIZE": _A_PUT}
_ACTIONS |= {n: _A_PUT for n in ("PUT", "BINPUT", "LONG_BINPUT")}
_ACTIONS |= {n: _A_GET for n in ("GET", "BINGET", "LONG_BINGET")}
_ROW = 8  # bytes per opcode in the table: kind, size, action, values taken, takes to a mark, makes one

Row = tuple[int, int, int, int, bool, bool]


def _kind(op: pickletools.OpcodeInfo) -> tuple[int, int]:
    arg = op.arg
    if arg is None:
        return _K_NONE, 0
    if arg.n >= 0:
        return _K_FIXED, arg.n
    if arg.n == pickletools.UP_TO_NEWLINE:
        return (_K_TWO_LINES if arg.name == "stringnl_noescape_pair" else _K_LINE), 0
    lengths = {
        pickletools.TAKEN_FROM_ARGUMENT1: _K_LEN1,
        pickletools.TAKEN_FROM_ARGUMENT4: _K_LEN4S,
        pickletools.TAKEN_FROM_ARGUMENT4U: _K_LEN4U,
        pickletools.TAKEN_FROM_ARGUMENT8U: _K_LEN8U,
    }
    return lengths[arg.n], 0


def _rows() -> list[Row | None]:
    """Per opcode byte, from pickletools' own description of each opcode; None for an unknown one."""
    rows: list[Row | None] = [None] * 256
    for op in pickletools.opcodes:
        before = op.stack_before
        mark = pickletools.markobject in before
        if mark:
            before = before[: before.index(pickletools.markobject)]
        action = _ACTIONS.get(op.name, _A_MUTATE if op.name in _MUTATES else _A_BUILD)
        kind, size = _kind(op)
        rows[op.code.encode("latin-1")[0]] = (kind, size, action, len(before), mark, bool(op.stack_after))
    return rows


_ROWS = _rows()
_TABLE = b"".join(
    bytes([*r, 0, 0]) if r is not None else bytes([_K_UNKNOWN]) + bytes(_ROW - 1) for r in _ROWS
)


class PickleShapeError(ValueError):
    """The pickle is malformed, or nests deeper than `MAX_DEPTH` (`too_deep`): refused before it is loaded."""

    def __init__(self, message: str, too_deep: bool = False) -> None:
        super().__init__(message)
        self.too_deep = too_deep


def scan_py(data: bytes, limit: int = MAX_DEPTH) -> tuple[int, int, int]:
    """The scan in Python: (verdict, byte offset of the opcode, detail); `_pickle_depth.scan` in C."""
    end = len(data)
    rows = _ROWS
    # A value's depth, or -1 - its cell once the memo (or DUP) shares it: cells[i] is a shared value's depth.
    stack: list[int] = []
    cells: list[int] = []
    inside: list[bool] = []  # whether the shared value was put inside another, which fixed its depth there
    marks: list[int] = []
    memo: dict[int, int] = {}  # key -> cell
    fence = pos = puts = 0
    while pos < end:
        at = pos
        row = rows[data[pos]]
        if row is None:
            return UNKNOWN_OPCODE, at, data[pos]
        kind, size, action, n, mark, makes = row
        pos += 1
        start = pos
        if kind == _K_FIXED:
            pos += size
        elif kind in (_K_LINE, _K_TWO_LINES):
            for _ in range(kind - _K_LINE + 1):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    return TRUNCATED, at, 0
                pos = nl + 1
        elif kind != _K_NONE:
            width = (1, 4, 4, 8)[kind - _K_LEN1]
            if pos + width > end:
                return TRUNCATED, at, 0
            length = int.from_bytes(data[pos : pos + width], "little", signed=kind == _K_LEN4S)
            if length < 0:
                return NEGATIVE, at, 0
            pos += width + length
        if pos > end:
            return TRUNCATED, at, 0
        if action in (_A_BUILD, _A_MUTATE, _A_STOP):
            if mark:
                if not marks:
                    return NO_MARK, at, 0
                top = marks.pop()
                fence = marks[-1] if marks else 0
            else:
                top = len(stack)
            lo = top - n
            if lo < fence:
                return UNDERFLOW, at, 0
            if action == _A_STOP:
                return OK, at, 0
            first = lo + 1 if action == _A_MUTATE else lo
            keeps = action == _A_MUTATE or makes
            d = 0
            for v in stack[first:]:
                if v < 0:
                    inside[-1 - v] |= keeps
                    v = cells[-1 - v]
                if v >= d:
                    d = v + 1
            del stack[first:]
            if action == _A_MUTATE:
                v = stack[lo]
                if v >= 0:
                    stack[lo] = d = max(v, d)
                elif d <= cells[-1 - v]:
                    d = cells[-1 - v]
                elif inside[-1 - v]:  # its holders were counted when it was shallower
                    return GROWS_INSIDE, at, 0
                else:
                    cells[-1 - v] = d
            elif makes:
                stack.append(d)
            else:
                continue
            if d > limit:
                return TOO_DEEP, at, d
        elif action == _A_MARK:
            marks.append(len(stack))
            fence = len(stack)
        elif action == _A_POP:
            if marks and marks[-1] == len(stack):
                marks.pop()
                fence = marks[-1] if marks else 0
            elif len(stack) <= fence:
                return UNDERFLOW, at, 0
            else:
                stack.pop()
        else:  # PUT, GET, DUP
            if kind == _K_LINE:
                line = data[start : pos - 1]
                if not (0 < len(line) <= 18 and line.isdigit()):
                    return BAD_KEY, at, 0
                key = int(line)
            elif kind == _K_FIXED:
                key = int.from_bytes(data[start:pos], "little")
            else:
                key = len(memo)
            if action == _A_GET:
                cell = memo.get(key)
                if cell is None:
                    return NOT_STORED, at, key
                stack.append(-1 - cell)
                continue
            if len(stack) <= fence:
                return UNDERFLOW, at, 0
            if action == _A_PUT:
                if key > puts:
                    return KEY_AHEAD, at, key
                puts += 1
            if stack[-1] >= 0:
                cells.append(stack[-1])
                inside.append(False)
                stack[-1] = -len(cells)
            if action == _A_DUP:
                stack.append(stack[-1])
            else:
                memo[key] = -1 - stack[-1]
    return TRUNCATED, end, 0


def _message(verdict: int, at: int, detail: int, limit: int) -> str:
    if verdict == TOO_DEEP:
        return f"nests values more than {limit} deep"
    what = {
        TRUNCATED: "it ends before its STOP",
        UNKNOWN_OPCODE: f"unknown opcode 0x{detail:02x}",
        UNDERFLOW: "stack underflow",
        NO_MARK: "no MARK before it",
        BAD_KEY: "a memo key that is not a short decimal",
        KEY_AHEAD: f"memo key {detail} skips keys never stored",
        NOT_STORED: f"memo key {detail} was never stored",
        NEGATIVE: "a negative length",
        GROWS_INSIDE: "a value grows after it was put inside another (a cycle)",
    }[verdict]
    return f"malformed pickle: {what} (the opcode at byte {at})"


def check_depth(data: bytes | bytearray | memoryview, limit: int = MAX_DEPTH) -> None:
    """Raise PickleShapeError if any value `data` builds nests more than `limit` deep, or it is malformed."""
    if _pickle_depth is not None:
        verdict, at, detail = _pickle_depth.scan(data, _TABLE, limit)
    else:
        verdict, at, detail = scan_py(bytes(data), limit)
    if verdict != OK:
        raise PickleShapeError(_message(verdict, at, detail, limit), too_deep=verdict == TOO_DEEP)


def show(value: object) -> str:
    """A bounded repr of an unpickled value, for an error message: never deep, never long."""
    return _SHOW.repr(value)
