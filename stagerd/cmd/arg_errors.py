"""How a command line argparse refuses is said: one line and what to do, as every other bad input is,
instead of argparse's usage block; a misspelt flag names the flag of that command it is closest to."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn


class CommandParser(argparse.ArgumentParser):
    """`stagerd` and each command's parser (add_subparsers makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        # Python before 3.14 names no close choice: `stagerd restor` gets `restore` named here
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            near = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1)
            message += f"; did you mean {near[0]}?" if near else ""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"  what to do: see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)

    def command_parser(self, command: str) -> CommandParser:
        sub = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command]
        assert isinstance(parser, CommandParser)
        return parser

    def refuse_unknown(self, extra: list[str], parent: argparse.ArgumentParser) -> NoReturn:
        """The arguments a command's parser did not take: each flag among them with the one meant, of this
        command or of `parent` (`stagerd --debug`)."""
        flags = [f for p in (self, parent) for a in p._actions for f in a.option_strings]
        said = []
        for arg in extra:
            near = difflib.get_close_matches(arg.split("=")[0], flags, n=1, cutoff=0.6)
            meant = f" (did you mean {near[0]}?)" if arg.startswith("-") and near else ""
            said.append(arg + meant)
        self.error(f"unrecognized arguments: {' '.join(said)}")
