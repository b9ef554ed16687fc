"""README.md stays true: its commands parse, its configuration table is the settings, its snippet is the API.

`python tests/test_readme.py` prints the configuration table as it should read.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

from stagerd.cli import build_parser
from stagerd.config import Settings, settings_table

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def _blocks(text: str, lang: str | None = None) -> list[str]:
    """Fenced code blocks, optionally only those of one language."""
    found = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    return [body for tag, body in found if lang is None or tag == lang]


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _commands(text: str) -> list[list[str]]:
    """Every `stagerd ...` invocation in a shell block: also after `&&` or `|`, and after `VAR=value`."""
    out = []
    for body in _blocks(text, "bash") + _blocks(text, "sh"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part.strip())
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words[:1] == ["stagerd"]:
                    out.append(words)
    return out


def _watch_flags() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {}
    for action in sub.choices["watch"]._actions:
        if action.option_strings and action.dest != "help":
            flags[action.dest] = action.option_strings[-1]
        elif not action.option_strings:
            flags[action.dest] = action.metavar
    return flags


def config_table() -> str:
    """The configuration reference as README.md must show it: one row per setting."""
    flags = _watch_flags()
    rows = [
        "| setting | flag of `stagerd watch` | environment | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, env, default, description in settings_table():
        flag = f"`{flags[name]}`" if name in flags else "-"
        text = description.replace("|", "\\|")
        rows.append(f"| `{name}` | {flag} | `{env}` | `{default}` | {text} |")
    return "\n".join(rows)


def test_setup_is_two_commands() -> None:
    setup = _section(README.read_text(), "Set up")
    install, tests = _blocks(setup)  # exactly two
    ci = (REPO / ".ci" / "run").read_text()
    pin = re.search(r"pip install --quiet -c tests/constraints.txt (torch==\S+)", ci).group(1)
    assert pin in install and "-e '.[test]'" in install and "-c tests/constraints.txt" in install
    assert install.strip().endswith("&& stagerd demo")
    test_cmd = tests.strip().split("&&")[-1].strip()
    assert test_cmd in ci  # CI runs the README's test command


def test_every_command_parses() -> None:
    commands = _commands(README.read_text())
    assert ["stagerd", "demo", "--sink", "s3://scratch/stagerd-demo"] in commands
    seen = {words[1] for words in commands if len(words) > 1}
    assert {"demo", "watch", "status", "consolidate", "verify", "publish"} <= seen, seen
    for words in commands:
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as e:  # argparse refused it (or it was --help, which is fine)
            assert e.code == 0, f"README command does not parse: {shlex.join(words)}"


def test_config_table_is_the_settings() -> None:
    section = _section(README.read_text(), "Configuration reference")
    expected = config_table()
    assert expected in section, f"README's configuration table is stale; it should read:\n{expected}"
    for name in Settings.model_fields:
        assert f"`STAGERD_{name.upper()}`" in section


def test_training_snippet_matches_the_stager() -> None:
    """The snippet compiles, and every Stager method and keyword it uses exists."""
    from stagerd import Stager

    blocks = _blocks(_section(README.read_text(), "Training side"), "python")
    snippet = next(b for b in blocks if "from stagerd import Stager" in b)
    tree = ast.parse(snippet)
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("stagerd", "Stager") in imports
    used = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "Stager":
            target = Stager.__init__
        elif (
            isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "stager"
        ):
            assert hasattr(Stager, func.attr), f"Stager has no {func.attr}()"
            target = getattr(Stager, func.attr)
        else:
            continue
        used += 1
        params = inspect.signature(target).parameters
        for kw in node.keywords:
            assert kw.arg in params, f"{target.__qualname__} takes no {kw.arg}="
    assert used >= 4  # Stager(), save(), wait_staged(), wait()


def test_the_first_training_example_is_the_trainer_callback() -> None:
    """It compiles, its keywords are the callback's or Stager.save's, and `resume` exists."""
    from stagerd import Stager
    from stagerd.integrations.transformers import StagerdCallback

    snippet = _blocks(_section(README.read_text(), "Training side"), "python")[0]
    tree = ast.parse(snippet)
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("stagerd.integrations.transformers", "StagerdCallback") in imports
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    (made,) = [n for n in calls if isinstance(n.func, ast.Name) and n.func.id == "StagerdCallback"]
    accepted = set(inspect.signature(StagerdCallback.__init__).parameters)
    accepted |= set(inspect.signature(Stager.save).parameters) - {"model", "optimizer_state"}
    assert {kw.arg for kw in made.keywords} <= accepted
    assert any(isinstance(n.func, ast.Attribute) and n.func.attr == "resume" for n in calls)
    assert callable(StagerdCallback.resume)


def test_every_sink_form_is_documented() -> None:
    section = _section(README.read_text(), "Sink URLs")
    for form in ("hf://ORG/REPO", "s3://BUCKET/PREFIX", "file:///PATH", "AWS_ENDPOINT_URL", "HF_TOKEN"):
        assert form in section, form


def test_deploy_files_named_exist() -> None:
    text = README.read_text()
    for rel in re.findall(r"`((?:systemd|docker|examples|bench)/[\w@.\-/]+)`", text):
        assert (REPO / rel).exists(), f"README names {rel}, which does not exist"


@pytest.mark.parametrize(
    "title",
    [
        "Training side",
        "Deploy",
        "Configuration reference",
        "Sink URLs",
        "On-disk contract",
        "Failure semantics",
    ],
)
def test_sections_present(title: str) -> None:
    assert _section(README.read_text(), title).strip()


def test_xet_note() -> None:
    text = README.read_text()
    assert "HF_HUB_DISABLE_XET=1" in text and "hf_xet" in text


if __name__ == "__main__":
    sys.stdout.write(config_table() + "\n")


def test_the_readme_speaks_to_users_not_of_the_work() -> None:
    """Issue numbers are the project's history, which a user reading the README has no use for."""
    cited = re.findall(r"(?i)\bissues? #?\d+", README.read_text())
    assert cited == []
