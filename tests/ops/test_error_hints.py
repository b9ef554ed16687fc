"""A named error's hint reaches a traceback in the user's own program (the training side's errors surface
there, where no CLI prints the hint), as the exception's first note; its message stays one line."""

from __future__ import annotations

import pickle
import subprocess
import sys
import traceback

from stagerd.errors import LoadError, SaveError, StagerdError


def _shown(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


def test_the_hint_is_the_first_note_and_follows_a_later_hint() -> None:
    e = SaveError("step 3 was not committed", path="/r/step-3")
    assert str(e) == "/r/step-3: step 3 was not committed"
    assert e.__notes__ == [f"what to do: {SaveError.hint}"]
    e.hint = "free space on the staging root and save again"
    e.add_note("another note")
    assert e.__notes__ == ["what to do: free space on the staging root and save again", "another note"]
    assert _shown(e).count("what to do:") == 1
    given = LoadError("bad", hint="restore it first")
    assert given.__notes__ == ["what to do: restore it first"]
    back = pickle.loads(pickle.dumps(given))
    assert back.__notes__ == ["what to do: restore it first"] and back.hint == "restore it first"


def test_the_cli_advice_is_no_note() -> None:
    assert not hasattr(StagerdError("x"), "__notes__")


def test_an_uncaught_error_in_a_program_shows_what_to_do(tmp_path) -> None:
    code = f"from stagerd import Stager\nStager({str(tmp_path / 'root')!r}).load({{}})\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("stagerd.errors.LoadError: "), proc.stderr
    assert last[1].startswith("what to do: "), proc.stderr
