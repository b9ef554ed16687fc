"""How deeply a pickle nests its values, found by reading its opcodes before anything is unpickled.

An allowlist decides which globals a pickle may name, not what shape its plain values take. A tuple nested a
million deep costs one byte per level, and CPython 3.11 hashes a tuple by recursing in C with no depth
check: the unpickler hashes every dict key and set element, so such a key kills the process (SIGSEGV)
whatever the allowlist says. Every value gets a depth here, one more than the deepest value it was built
from or given (a list by APPEND, a record by BUILD); a pickle whose depth passes `MAX_DEPTH` is refused
before it is loaded. The depth of a value is kept where the memo refers to it, so a value fetched again is
as deep as it has grown; a container that grows after it was put inside another can hide depth from its
holder, but only through a list, dict, set or record, whose hash does not recurse, so a deep hash always
passes through a tuple counted here. Callers also never repr or str such values unbounded (`show`).
"""

from __future__ import annotations

import pickletools
import reprlib
from typing import Any

MAX_DEPTH = 100  # DCP's metadata and torch.save records nest under 10
_MUTATES = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 3, 60, 60


class PickleShapeError(ValueError):
    """The pickle is malformed, or nests deeper than `MAX_DEPTH`: refused before it is loaded."""


def _table() -> dict[str, tuple[int, int, bool, bool]]:
    """Per opcode name: (action, values taken below the mark or from the top, takes to a mark, makes one)."""
    out = {}
    for op in pickletools.opcodes:
        before, mark = op.stack_before, pickletools.markobject in op.stack_before
        if mark:
            before = before[: before.index(pickletools.markobject)]
        action = _MUTATE if op.name in _MUTATES else _BUILD
        if op.name == "MARK":
            action = _MARK
        elif op.name in _PUTS or op.name == "MEMOIZE":
            action = _PUT
        elif op.name in _GETS:
            action = _GET
        elif op.name == "DUP":
            action = _DUP
        out[op.name] = (action, len(before), mark, bool(op.stack_after))
    return out


_BUILD, _MUTATE, _MARK, _PUT, _GET, _DUP = range(6)
_OPS = _table()


def check_depth(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Raise PickleShapeError if any value `data` builds nests more than `limit` deep."""
    # A value is a one-item list holding its depth, shared by the stack and the memo.
    stack: list[list[int]] = []
    marks: list[int] = []
    memo: dict[Any, list[int]] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            action, n, mark, makes = _OPS[op.name]
            if action == _GET:
                stack.append(memo[arg])
            elif action == _PUT:
                memo[len(memo) if arg is None else arg] = stack[-1]
            elif action == _MARK:
                marks.append(len(stack))
            elif action == _DUP:
                stack.append(stack[-1])
            else:
                at = marks.pop() if mark else len(stack)
                if at - n < 0:
                    raise IndexError("stack underflow")
                taken = stack[at - n :]
                del stack[at - n :]
                if not makes:
                    continue
                deepest = max([c[0] for c in taken[action == _MUTATE :]], default=-1) + 1
                if action == _MUTATE:
                    cell = taken[0]
                    cell[0] = max(cell[0], deepest)
                else:
                    cell = [deepest]
                if cell[0] > limit:
                    raise PickleShapeError(f"nests values more than {limit} deep")
                stack.append(cell)
    except PickleShapeError:
        raise
    except Exception as e:  # truncated, an unknown opcode, a memo index never stored, stack underflow
        raise PickleShapeError(f"malformed pickle: {type(e).__name__}: {e}") from None


def show(value: object) -> str:
    """A bounded repr of an unpickled value, for an error message: never deep, never long."""
    return _SHOW.repr(value)
