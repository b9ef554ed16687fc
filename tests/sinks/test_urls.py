"""Sink URLs are parsed strictly, in one place, before anything runs.

Each refused form is one a tired operator types: before, most of them published into a stray directory
under the working directory and reported success. Every case runs through the real `stagerd` command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.errors import ConfigError
from stagerd.sinks import SinkKind, open_sink, parse_sink_url
from tests.cli_helpers import run_cli

# (URL as typed, the closest valid form the hint must offer; {cwd} is the working directory)
REFUSED = [
    ("", None),
    ("   ", None),
    ("relative/dir", "file://{cwd}/relative/dir"),
    ("./out", "file://{cwd}/out"),
    ("s3:/bucket/run", "s3://bucket/run"),
    ("hf:/org/repo", "hf://org/repo"),
    ("file://relative/dir", "file://{cwd}/relative/dir"),
    ("file://tmp/run", "file:///tmp/run"),  # a slash lost, not a path under the working directory
    ("file:relative", "file://{cwd}/relative"),
    ("file://", "file:///ABSOLUTE/PATH"),
    ("file:///", None),
    ("hf://org/repo#main", "hf://org/repo@main"),
    ("hf://org/repo@v1@v2", "hf://org/repo@v1"),
    ("hf://org/repo@", None),
    ("hf://org", None),
    ("memory://x/y", None),
    ("file:///x?x=1", "file:///x"),
    ("s3:///bucket/run", "s3://bucket/run"),
    ("s3://bucket//run", "s3://bucket/run"),
    ("S3://bucket/run", "s3://bucket/run"),
    ("s3://key:secret@bucket/run", "s3://bucket/run"),
    ("file:///srv/../etc", "file:///etc"),
    ("foo://x", None),
    ("http://host/x", None),
    ("simplecache::s3://bucket/run", "s3://bucket/run"),
]


def _check_refusal(proc, typed: str, hint: str | None, cwd: Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("stagerd: ConfigError: sink URL")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    if hint is not None:
        assert f"did you mean {hint.format(cwd=cwd)!r}?" in proc.stderr, proc.stderr
    assert ":secret@" not in proc.stderr
    assert list(cwd.iterdir()) == [], "a refused sink must create nothing"


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    here = tmp_path / "cwd"
    here.mkdir()
    return here


@pytest.mark.parametrize(("typed", "hint"), REFUSED, ids=[repr(t) for t, _ in REFUSED])
def test_watch_refuses(typed: str, hint: str | None, cwd: Path) -> None:
    proc = run_cli(["watch", "root", "--sink", typed, "--once"], cwd=cwd)
    _check_refusal(proc, typed, hint, cwd)


@pytest.mark.parametrize(
    ("typed", "hint"),
    [("s3:/bucket/run", "s3://bucket/run"), ("file://relative/dir", "file://{cwd}/relative/dir")],
)
def test_watch_refuses_from_the_environment_and_a_config_file(typed: str, hint: str, cwd: Path) -> None:
    proc = run_cli(["watch", "root", "--once"], env={"STAGERD_SINKS": f"file:///srv/ok,{typed}"}, cwd=cwd)
    _check_refusal(proc, typed, hint, cwd)
    config = cwd.parent / "stagerd.toml"
    config.write_text(f"sinks = [{json.dumps(typed)}]\n")
    proc = run_cli(["watch", "root", "--config", config, "--once"], cwd=cwd)
    _check_refusal(proc, typed, hint, cwd)


def test_an_empty_environment_list_is_no_sink(cwd: Path) -> None:
    proc = run_cli(["watch", "root", "--once"], env={"STAGERD_SINKS": ""}, cwd=cwd)
    assert proc.returncode == 2 and "ConfigError: no sink" in proc.stderr
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("typed", "hint"),
    [("", None), ("s3:/bucket/run", "s3://bucket/run"), ("hf://org/repo#main", "hf://org/repo@main")],
)
def test_publish_refuses_before_any_sink_is_touched(typed: str, hint: str | None, cwd: Path) -> None:
    export = cwd.parent / "step-00000007" / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"x" * 16)
    good = cwd.parent / "good"
    proc = run_cli(["publish", export, "--sink", good.as_uri(), "--sink", typed], cwd=cwd)
    _check_refusal(proc, typed, hint, cwd)
    assert not good.exists(), "the valid sink listed first must not have been published to"


def test_demo_refuses_before_training(cwd: Path) -> None:
    root = cwd.parent / "demo"
    proc = run_cli(["demo", "--root", root, "--sink", "hf:/org/repo"], cwd=cwd)
    _check_refusal(proc, "hf:/org/repo", "hf://org/repo", cwd)
    assert not root.exists()


# --- the accepted forms, and what they name ------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind", "location", "path"),
    [
        ("s3://bucket/run", SinkKind.S3, "bucket", "run"),
        ("s3://b", SinkKind.S3, "b", ""),
        ("s3a://bucket/a/b/", SinkKind.S3, "bucket", "a/b"),
        ("hf://org/repo", SinkKind.HUB, "org/repo", ""),
        ("hf://org/repo@release?private=false", SinkKind.HUB, "org/repo", "release"),
        ("file:///srv/ckpt", SinkKind.LOCAL, "", "/srv/ckpt"),
        ("file:///srv/ckpt/", SinkKind.LOCAL, "", "/srv/ckpt"),
        ("/srv/ckpt", SinkKind.LOCAL, "", "/srv/ckpt"),
    ],
)
def test_accepted_forms(url: str, kind: SinkKind, location: str, path: str) -> None:
    got = parse_sink_url(url)
    assert (got.url, got.kind, got.location, got.path) == (url, kind, location, path)


def test_a_bare_absolute_path_is_a_local_sink(tmp_path: Path) -> None:
    """Documented in `stagerd watch --help`: /PATH means file:///PATH."""
    sink = open_sink(str(tmp_path / "dest"))
    assert parse_sink_url(str(tmp_path / "dest")).local_path == tmp_path / "dest"
    sink.close()


def test_open_sink_refuses_what_the_parser_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for typed, _ in REFUSED:
        with pytest.raises(ConfigError):
            open_sink(typed)
    assert list(tmp_path.iterdir()) == []


def test_secrets_in_a_refused_url_are_masked() -> None:
    with pytest.raises(ConfigError) as e:
        parse_sink_url("hf://org/repo@v1@v2?token=hf_supersecretvalue")
    assert "hf_supersecretvalue" not in str(e.value) + e.value.hint


def test_a_suggested_url_reads_as_typed_its_secrets_masked() -> None:
    """The suggestion is what to type: its query as the user wrote it, not percent-encoded again."""
    with pytest.raises(ConfigError) as e:
        parse_sink_url("hf:/org/repo?endpoint=http://127.0.0.1:8080&token=hf_supersecretvalue")
    assert e.value.hint == "did you mean 'hf://org/repo?endpoint=http://127.0.0.1:8080&token=***'?", (
        e.value.hint
    )
    assert "hf:/org/repo?endpoint=http://127.0.0.1:8080&token=***" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_sink_url("s3:/user:pass@bkt/run")
    assert "pass" not in str(e.value) + e.value.hint and "s3://user:***@bkt/run" in e.value.hint


@pytest.mark.parametrize("url", ["s3://bkt/run*", "s3://bkt/exp[1]", "s3a://bkt/a]b", "s3://bkt/run*/x"])
def test_an_object_store_prefix_with_glob_characters_is_refused(url: str) -> None:
    """S3 tools read `*`, `?`, `[`, `]` as patterns: one delete could reach other prefixes."""
    from stagerd.errors import ConfigError
    from stagerd.sinks.fetch import RemoteStore

    with pytest.raises(ConfigError, match="glob character") as ei:
        parse_sink_url(url)
    assert "copy it to such a prefix" in ei.value.hint
    with pytest.raises(ConfigError, match="glob character"):
        RemoteStore.open(url)  # `stagerd prune` and `restore` open stores without the parser
    assert parse_sink_url("file:///srv/run*").path == "/srv/run*"  # local paths are exact os calls


def test_a_file_url_with_percent_escapes_is_refused(tmp_path: Path) -> None:
    """`Path("/data/my run").as_uri()` is `file:///data/my%20run`. Before the fix it was accepted and the
    stores, which do not decode it, published into a new directory `my%20run` beside `my run`."""
    wanted = tmp_path / "my run"
    with pytest.raises(ConfigError, match="%-escapes") as e:
        open_sink(wanted.as_uri())
    assert e.value.hint == f"did you mean {str(wanted)!r}?"
    assert list(tmp_path.iterdir()) == []
    assert parse_sink_url(str(tmp_path / "my%20run")).path == str(tmp_path / "my%20run")  # bare: exact
    assert parse_sink_url("file:///srv/100%").path == "/srv/100%"  # no escape in it
