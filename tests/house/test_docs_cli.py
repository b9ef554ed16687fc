"""What the documents promise about the command line is what the code does: the configuration table's
rows are the settings, each with its real flag, variable and default, and every `stagerd COMMAND --flag`
they show is a flag that command takes. Read from the text, checked against the parser and the settings
themselves, so a renamed flag or a changed default fails here before a user meets it."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from pydantic import ByteSize, TypeAdapter
from pydantic_settings import EnvSettingsSource

from stagerd.cli import build_parser
from stagerd.cmd import watch
from stagerd.config import Settings
from stagerd.daemon.settings_sources import _NOT_SETTINGS
from stagerd.sinks.hub.options import KNOWN as HUB_OPTIONS
from stagerd.sinks.hub.timeouts import HubTimeouts

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "ARCHITECTURE.md"]
TABLE_HEAD = "| setting | flag of `stagerd watch` | environment | default | meaning |"

# Flags of `stagerd watch` that set no setting, so have no row: documented in the prose above the table.
NOT_IN_TABLE = {"--help": "argparse's own", "--config": "the TOML file the table's settings come from"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _table_rows() -> list[list[str]]:
    """The configuration table's rows, each cell stripped of its code span; `\\|` is a `|` in a cell."""
    section = _section((REPO / "README.md").read_text(), "Configuration reference")
    lines = section.splitlines()
    assert TABLE_HEAD in lines, "the configuration table's header changed"
    rows = []
    for line in lines[lines.index(TABLE_HEAD) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append([c[1:-1] if len(c) > 1 and c[0] == c[-1] == "`" else c for c in cells])
    return rows


def _same_default(shown: str, real: Any) -> bool:
    """`None`, `[]`, `30.0`, `'idle'` as Python literals (`30` is `30.0`, `0` is not `False`); a bare word
    as the string it spells."""
    try:
        value = ast.literal_eval(shown)
    except (ValueError, SyntaxError):
        return isinstance(real, str) and shown == real
    return value == real and isinstance(value, bool) == isinstance(real, bool)


def _variables() -> dict[str, str]:
    """variable -> setting, as the settings' environment source reads them."""
    names = {}
    for name, field in Settings.model_fields.items():
        for _key, env, _complex in EnvSettingsSource(Settings)._extract_field_info(field, name):
            names[env.upper()] = name
    return names


def test_every_row_is_a_setting_with_its_real_flag_variable_and_default():
    flags = {a.dest: a for a in _subparsers()["watch"]._actions}
    names = _variables()
    wrong = []
    for setting, flag, env, default, _meaning in _table_rows():
        if setting not in Settings.model_fields:
            wrong.append(f"{setting}: not a setting")
            continue
        action = flags.get(setting)
        if flag == "-":
            if action is not None:
                has = (action.option_strings or [action.metavar])[-1]
                wrong.append(f"{setting}: shown without a flag, but has {has}")
        elif action is None or flag not in (action.option_strings or [action.metavar]):
            wrong.append(f"{setting}: {flag} is not the watch flag that sets it")
        elif setting not in watch._FLAGS:
            wrong.append(f"{setting}: {flag} is parsed but never given to the settings (watch._FLAGS)")
        if names.get(env) != setting:
            wrong.append(f"{setting}: {env} is not the variable it is read from")
        real = Settings.model_fields[setting].get_default(call_default_factory=True)
        if not _same_default(default, real):
            wrong.append(f"{setting}: default shown {default}, is {real!r}")
    assert wrong == [], "README's configuration table:\n" + "\n".join(wrong)


def test_every_setting_and_every_watch_flag_has_its_row():
    rows = _table_rows()
    settings = [r[0] for r in rows]
    assert sorted(settings) == sorted(Settings.model_fields), "settings without a row, or rows twice"
    shown = {r[1] for r in rows}
    watch_flags = {
        a.option_strings[-1] if a.option_strings else a.metavar for a in _subparsers()["watch"]._actions
    }
    assert sorted(watch_flags - shown - set(NOT_IN_TABLE)) == []
    section = _section((REPO / "README.md").read_text(), "Configuration reference")
    assert "`--config FILE`" in section


# Where a user is shown variables to set: the documents, and the deployment files they copy.
WITH_VARIABLES = [*DOCS, "RELIABILITY.md", "systemd/stagerd.env.example", "docker/k8s-sidecar.yaml"]


@pytest.mark.parametrize("doc", WITH_VARIABLES)
def test_every_variable_named_is_read(doc: str):
    """A `STAGERD_*` variable a user is told of is a setting's, or one read elsewhere (a fleet node's id,
    the fault-injection hooks): a misspelt one would be warned about and ignored."""
    named = set(re.findall(r"\bSTAGERD_[A-Z][A-Z0-9_]*", (REPO / doc).read_text()))
    unread = {v for v in named - set(_variables()) if not v.startswith(_NOT_SETTINGS)}
    assert sorted(unread) == []


def test_the_hub_options_shown_are_the_hub_sinks():
    """The sink table's row of `hf://` URL options: each is one the Hub sink takes, with its default."""
    section = _section((REPO / "README.md").read_text(), "Sink URLs")
    (row,) = [line for line in section.splitlines() if line.startswith("| `hf://ORG/REPO?")]
    options = row.split("|")[2]
    assert sorted(set(re.findall(r"`(\w+)`", options)) - HUB_OPTIONS) == []
    said = dict(re.findall(r"`(\w+)` \(s, default (\d+)\)", options))
    assert {k: float(v) for k, v in said.items()} == {
        "timeout": HubTimeouts.read,
        "connect_timeout": HubTimeouts.connect,
    }


# `stagerd watch --help` says a flag's default in its help: the setting's, but where it is computed.
COMPUTED_DEFAULTS = {"max_shard_size": "one daemon's and a fleet's: test_the_shard_size_default_is_..."}


def test_each_watch_flags_help_names_the_settings_default():
    wrong = []
    for action in _subparsers()["watch"]._actions:
        m = re.search(r"\(default ([^;)]+)", action.help or "")
        if m is None or action.dest in COMPUTED_DEFAULTS:
            continue
        real = Settings.model_fields[action.dest].get_default()
        if not _same_default(m.group(1), real):
            wrong.append(f"{action.option_strings[-1]}: help says default {m.group(1)}, is {real!r}")
    assert wrong == []


def test_the_shard_size_default_is_the_one_said():
    """Unset, the largest file is one daemon's size, or a fleet's (or with an exchange): as the table's
    row and `--help` say."""
    size = TypeAdapter(ByteSize).validate_python
    alone = Settings.model_construct().shard_size()
    fleet = Settings.model_construct().shard_size(fleet=True)
    assert fleet == Settings.model_construct(exchange="s3://b/x").shard_size()
    (row,) = [r for r in _table_rows() if r[0] == "max_shard_size"]
    said = re.search(
        r"Unset: (\w+),.*; (\w+) for a step staged on several nodes \(or with exchange\)", row[4]
    )
    assert said and (size(said[1]), size(said[2])) == (alone, fleet), row[4]
    (action,) = [a for a in _subparsers()["watch"]._actions if a.dest == "max_shard_size"]
    said = re.search(r"\(default (\w+); (\w+) with --exchange\)", action.help or "")
    assert said and (size(said[1]), size(said[2])) == (alone, fleet), action.help


# ---- every `stagerd COMMAND ... --flag` shown is a flag of that command ----

SHELL_SPLIT = re.compile(r"&&|\|\||;|\|")


FENCED = re.compile(r"^ *```([\w-]*)\n(.*?)^ *```", re.M | re.S)


def _spans(text: str) -> list[str]:
    """The inline code spans, outside fenced blocks."""
    return re.findall(r"`([^`\n]+)`", FENCED.sub("", text))


def _code(text: str) -> list[str]:
    """Command lines: each line of a fenced block but Python (a `\\` continues it), each inline code span."""
    lines = []
    for tag, body in FENCED.findall(text):
        if tag != "python":
            lines += body.replace("\\\n", " ").splitlines()
    return lines + _spans(text)


def _invocations(line: str, commands: set[str]) -> list[list[str]]:
    """The words of each `stagerd ...` in a line: after `&&`, `|` or `VAR=value`, up to a `#` comment.
    A span that begins with a command's name and shows a flag (`watch --once`) is one too."""
    out = []
    for part in SHELL_SPLIT.split(line.split(" #")[0]):
        try:
            words = shlex.split(part, comments=False)
        except ValueError:  # an unbalanced quote: prose, not a command line
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["stagerd"]:
            out.append(words[1:])
        elif words[:1] and words[0] in commands and any(w.startswith("--") for w in words[1:]):
            out.append(words)
    return out


def _wrong_flags(lines: list[str]) -> list[str]:
    subs = _subparsers()
    top = _flags(build_parser())
    wrong = []
    for line in lines:
        for words in _invocations(line, set(subs)):
            rest = [w for w in words if not w.startswith("-")]
            if not rest or rest[0] not in subs:
                if words and not set(words) <= top:  # `stagerd --version` alone names no command
                    wrong.append(f"{line!r}: no stagerd command named")
                continue
            known = top | _flags(subs[rest[0]])
            for w in words:
                flag = w.strip("[]").split("=")[0]  # `[--step N]`: an optional flag in a synopsis
                if flag.startswith("--") and flag not in known:
                    wrong.append(f"{line!r}: {flag} is not a flag of `stagerd {rest[0]}`")
    return wrong


@pytest.mark.parametrize("doc", DOCS)
def test_every_stagerd_command_shown_takes_its_flags(doc: str):
    assert _wrong_flags(_code((REPO / doc).read_text())) == []


def test_every_stagerd_command_in_the_help_takes_its_flags():
    """The examples `stagerd --help` and each `stagerd COMMAND --help` end with."""
    parsers = [build_parser(), *_subparsers().values()]
    lines = [line for p in parsers for line in (p.epilog or "").splitlines()]
    assert sum(line.strip().startswith("stagerd watch") for line in lines) >= 5
    assert _wrong_flags(lines) == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_a_span_opens_with_is_a_stagerd_flag(doc: str):
    """`--keep-last N` in the prose, its command left to the sentence: some command of stagerd takes it."""
    known = _flags(build_parser()).union(*(_flags(p) for p in _subparsers().values()))
    opened = {s.split()[0].split("=")[0] for s in _spans((REPO / doc).read_text()) if re.match(r"--\w", s)}
    assert sorted(opened - known) == []


def test_the_flag_check_reads_blocks_spans_and_other_tools():
    """The reader finds a wrong flag in a block line, a continued line, a span, and after `&&`, and
    leaves other tools' flags alone."""
    text = "\n".join(
        [
            "```bash",
            "pip install -e . --no-deps && STAGERD_ROOT=/r stagerd watch --keep-lats 2",
            "stagerd status /r \\",
            "  --jsn",
            "torchrun --nproc-per-node 8 train.py  # stagerd watch --not-a-flag in a comment",
            "```",
            "Then `stagerd retry ROOT --stepp N`, or `verify --adopts`, or `stagerd wach ROOT`.",
            "`stagerd watch ROOT --once` and `stagerd --debug status ROOT --json` are right.",
        ]
    )
    assert [w.split(": ", 1)[1] for w in _wrong_flags(_code(text))] == [
        "--keep-lats is not a flag of `stagerd watch`",
        "--jsn is not a flag of `stagerd status`",
        "--stepp is not a flag of `stagerd retry`",
        "--adopts is not a flag of `stagerd verify`",
        "no stagerd command named",
    ]
