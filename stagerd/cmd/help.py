"""How every `stagerd` help text is laid out: prose wraps to the terminal, examples keep their lines."""

from __future__ import annotations

import argparse
import textwrap


class UserHelpFormatter(argparse.HelpFormatter):
    """Paragraphs (split at blank lines) are filled to the width; lines that start with a space, such as
    example commands, and the `examples:` heading are kept exactly as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.strip("\n").split("\n\n"):
            lines = para.splitlines()
            if any(ln.startswith(" ") or ln.endswith(":") for ln in lines):
                out.append("\n".join(indent + ln for ln in lines))
            else:
                out.append(
                    textwrap.fill(" ".join(lines), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(out)
