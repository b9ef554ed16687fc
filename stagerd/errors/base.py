"""The base of every named error: a one-line message, the file it is about, the hint of what to do next
(also the exception's first note, for a traceback in the user's own program), and whether retrying helps.
"""

from __future__ import annotations


class StagerdError(Exception):
    """Base of every error stagerd raises on purpose."""

    retryable: bool = False
    hint: str = "run with --debug for a traceback"

    def __init__(self, message: str, *, path: object | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = None if path is None else str(path)
        if hint is not None:
            self.hint = hint
        else:
            self._note_hint()

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "hint":
            self._note_hint()

    def _note_hint(self) -> None:
        """The hint as the exception's first note: a traceback in the user's own program (the training
        side's errors surface there, not through the CLI, which prints the hint itself) shows what to do."""
        if self.hint == StagerdError.hint:  # the CLI's own advice, meaningless in a program's traceback
            return
        note = f"{_NOTE}{self.hint}"
        notes = self.__dict__.get("__notes__")
        if notes and isinstance(notes[0], str) and notes[0].startswith(_NOTE):
            notes[0] = note
        else:
            self.add_note(note)

    @property
    def name(self) -> str:
        return type(self).__name__

    def __str__(self) -> str:
        return one_line(f"{self.path}: {self.message}" if self.path else self.message)


_NOTE = "what to do: "


def bounded(text: str, limit: int) -> str:
    """`text` with each character that is not printable a `?`, cut to `limit` characters (`…` marking the
    cut): text anyone could have written (a claim's host, a Hub account's name), named in a message."""
    shown = "".join(c if c.isprintable() else "?" for c in text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline, an escape sequence's ESC) written as
    its escape: a message quotes text from files, pickles and servers, and must stay one line in a
    terminal, a log and `status`."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
