"""The Hub sink's pure parts: its URL and the commit plan / tree comparison (no server)."""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError
from stagerd.sinks.hub import HubSink
from stagerd.sinks.hub.tree import HubFile, RemoteFile, compare_tree, plan_commit
from stagerd.sinks.hub.url import parse_hub_url


def test_url_parsing():
    t = parse_hub_url("hf://acme/llm@release?private=false&token=hf_abcdefghij")
    assert (t.repo_id, t.revision, t.options["private"]) == ("acme/llm", "release", "false")
    assert t.redacted == "hf://acme/llm@release"
    assert parse_hub_url("hf://acme/llm").revision is None
    for bad in ("s3://acme/llm", "hf://acme", "hf://a/b/c", "hf://acme/llm@", "hf://acme/ll m"):
        with pytest.raises(ConfigError):
            parse_hub_url(bad)
    for kind in ("datasets", "spaces"):
        with pytest.raises(ConfigError, match=f"model repos only, not {kind}"):
            parse_hub_url(f"hf://{kind}/acme/llm")
    with pytest.raises(ConfigError, match="colour"):
        HubSink.from_url("hf://acme/llm?colour=blue", token="x")
    with pytest.raises(ConfigError, match="private"):
        HubSink.from_url("hf://acme/llm?private=maybe", token="x")
    # a typo of a known option names the one meant, its value (a token's too) never shown
    with pytest.raises(ConfigError) as e:
        HubSink.from_url("hf://acme/llm?endpont=http://127.0.0.1:1&tokn=hf_secret123", token="x")
    assert "endpont (did you mean endpoint?), tokn (did you mean token?)" in e.value.message, e.value
    assert "hf_secret123" not in str(e.value)


def test_plan_and_compare_are_pure():
    a = HubFile("a.safetensors", 10, "1" * 64, None)
    b = HubFile("b.json", 3, "2" * 64, "g" * 40)
    parent = {
        ".gitattributes": RemoteFile(".gitattributes", 5, "x" * 40, None),
        "a.safetensors": RemoteFile("a.safetensors", 10, "p" * 40, "1" * 64),
        "old.safetensors": RemoteFile("old.safetensors", 7, "q" * 40, "9" * 64),
    }
    plan = plan_commit([a, b], None, parent)
    assert plan.adds == ("b.json",) and plan.deletes == ("old.safetensors",)
    assert plan.kept == ("a.safetensors",) and plan.new_bytes == 3  # a is there, byte for byte: not sent
    card = HubFile("README.md", 4, "5" * 64, "c" * 40)
    same_blob = {
        **parent,
        "b.json": RemoteFile("b.json", 3, "g" * 40, None),
        "README.md": parent["a.safetensors"],
    }
    plan = plan_commit([a, b], card, same_blob)  # a regular file is the same by its git blob id
    assert plan.adds == ("README.md",) and plan.kept == ("a.safetensors", "b.json") and plan.new_bytes == 4

    remote = {
        "a.safetensors": RemoteFile("a.safetensors", 10, "p" * 40, "3" * 64),
        "b.json": RemoteFile("b.json", 4, "g" * 40, None),
        "extra.bin": RemoteFile("extra.bin", 1, "e" * 40, None),
    }
    assert compare_tree([a, b], None, remote, card_exact=True) == [
        "a.safetensors: content differs (sha256/blob id)",
        "b.json: 4 bytes on the Hub, 3 in the export",
        "extra.bin: not in the export",
    ]


def test_only_titles_stagerd_writes_name_a_step():
    """Before: U+0661 read as step 1, and 5,000 digits raised ValueError out of the history's read."""
    from stagerd.contract.layout import MAX_STEP
    from stagerd.sinks.hub.url import commit_message, title_step

    assert title_step(commit_message(7)) == (7, None)
    assert title_step(commit_message(MAX_STEP, "dev")) == (MAX_STEP, "dev")
    for title in ["stagerd: step \u0661", "stagerd: step " + "9" * 5000, f"stagerd: step {MAX_STEP + 1}"]:
        assert title_step(title) is None
    assert title_step("stagerd: step 7\n") is None and title_step("stagerd: step 07") is None


def test_a_commits_authors_are_named_printable_and_bounded():
    """The Hub's history lists anyone's account names: a conflict's one-line message shows them tamed."""
    from stagerd.sinks.hub.authors import describe

    date = "2026-01-02T03:04:05.678Z"
    assert describe([{"user": "lab"}], date) == "Hub account lab, 2026-01-02 03:04 UTC"
    assert describe([{"user": "a\nb"}, {"user": "x" * 100}], "no date") == f"Hub accounts a?b, {'x' * 63}…"
    assert describe([{"user": n} for n in "abcd"], None) == "Hub accounts a, b, c, ..."
    assert describe([{"user": None}, "lab"], date) is None and describe({"user": "lab"}, date) is None
