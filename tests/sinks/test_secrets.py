"""Secrets never show: every line the CLI prints, every log record, every error, the status output, the
journal file and the metrics endpoints are searched for the test tokens and AWS secrets; zero hits.

Everything runs for real in child processes, with the secrets in the environment and in sink URLs: the
engine CLI, `stagerd publish` to moto S3 and to the Hub-protocol test server (good and bad credentials),
`stagerd watch --once` with three sinks (one failing), `stagerd status`, and a running daemon's /metrics
and /healthz, which must also listen on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from stagerd.contract import layout
from tests.cli_helpers import clean_env, run_cli, start_cli
from tests.hubserver import HubConfig, HubServer
from tests.s3server import SECRET_KEY, s3, s3_server  # noqa: F401  (fixtures)

BOGUS_HF_TOKEN = "hf_stagerdBOGUStoken0do0not0log"
BOGUS_AWS_SECRET = "stagerd-BOGUS-aws-secret-do-not-log"
SESSION_TOKEN = "stagerd-SESSION-token-do-not-log"
URL_PASSWORD = "stagerd-URL-password-do-not-log"
URL_TOKEN = "hf_stagerdURLtoken0do0not0log"
STATIC = {
    "bogus HF token": BOGUS_HF_TOKEN,
    "AWS secret": SECRET_KEY,
    "bogus AWS secret": BOGUS_AWS_SECRET,
    "AWS session token": SESSION_TOKEN,
    "URL password": URL_PASSWORD,
    "URL token": URL_TOKEN,
}


class Transcript:
    """Everything the runs printed, logged or stored, each piece labelled, searched for secrets at the end."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = {k: v for k, v in secrets.items() if v}
        self.pieces: list[tuple[str, str]] = []

    def add(self, label: str, text: str | bytes) -> None:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        self.pieces.append((label, text))

    def run(
        self, label: str, *args: str, env: dict[str, str], timeout: float = 180
    ) -> subprocess.CompletedProcess:
        r = run_cli(args, env=env, timeout=timeout)
        self.add(f"{label} (stdout)", r.stdout)
        self.add(f"{label} (stderr)", r.stderr)
        return r

    def add_tree(self, label: str, d: Path) -> None:
        """Every file under d, as bytes: journal, WAL, logs."""
        for p in sorted(d.rglob("*")):
            if p.is_file():
                self.add(f"{label}/{p.relative_to(d)}", p.read_bytes())

    def hits(self) -> list[str]:
        """`where: which secret` for every hit; the secret itself is never printed."""
        out = []
        for label, text in self.pieces:
            for name, value in self.secrets.items():
                # the whole value, and its distinctive tail (a truncated or re-quoted secret still counts)
                if value in text or value[len(value) // 2 :] in text:
                    out.append(f"{label}: {name}")
        return out

    def assert_clean(self) -> None:
        assert self.pieces and sum(len(t) for _, t in self.pieces) > 0
        hits = self.hits()
        assert not hits, "secrets leaked:\n  " + "\n  ".join(hits)


def secret_env(**extra: str) -> dict[str, str]:
    return clean_env(
        {
            "HF_TOKEN": BOGUS_HF_TOKEN,
            "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "stagerd-test-key"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            "HF_HUB_DISABLE_XET": None,  # Xet, the production upload path
            "HF_HUB_DISABLE_TELEMETRY": "1",
            **extra,
        }
    )


FAST_WATCH = ["--nice", "0", "--io-class", "none", "--rescan-seconds", "0.5"]


@pytest.fixture
def hub():
    with HubServer(config=HubConfig()) as server:
        yield server


# ---------------------------------------------------------------------------------------------- engine


def test_engine_cli_never_prints_a_secret(step_dir, tmp_path):
    t = Transcript(STATIC)
    env = secret_env(AWS_SESSION_TOKEN=SESSION_TOKEN)
    out = tmp_path / "out"

    assert t.run("consolidate", "consolidate", str(step_dir), str(out), env=env).returncode == 0
    assert t.run("verify", "verify", str(out), "--against", str(step_dir), env=env).returncode == 0
    shard = sorted((step_dir / "model").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-16])
    for debug in ([], ["--debug"]):
        r = t.run(
            f"consolidate a damaged step {debug}",
            *debug,
            "consolidate",
            str(step_dir),
            str(tmp_path / "x"),
            env=env,
        )
        assert r.returncode == 2
        r = t.run(
            f"verify a damaged step {debug}", *debug, "verify", str(out), "--against", str(step_dir), env=env
        )
        assert r.returncode == 2
    t.assert_clean()


# ---------------------------------------------------------------------------------------------- publish


def _export(tmp_path: Path, step_dir: Path) -> Path:
    from stagerd.engine.export import export_step

    export_step(step_dir)
    return step_dir / layout.EXPORT_DIR


def test_publish_paths_never_print_a_secret(s3, hub, step_dir, tmp_path):  # noqa: F811
    t = Transcript({**STATIC, "Hub write token": hub.token, "Hub read token": hub.read_token})
    export = _export(tmp_path, step_dir)
    hub_env = secret_env(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token)

    assert t.run("publish s3", "publish", str(export), "--sink", s3.url(), env=secret_env()).returncode == 0
    bad_s3 = secret_env(AWS_SECRET_ACCESS_KEY=BOGUS_AWS_SECRET, AWS_SESSION_TOKEN=SESSION_TOKEN)
    for debug in ([], ["--debug"]):
        r = t.run(
            f"publish s3, bad secret {debug}",
            *debug,
            "publish",
            str(export),
            "--sink",
            s3.url("x"),
            env=bad_s3,
        )
        assert r.returncode == 2 and "SinkAuthError" in r.stderr, r.stderr

    assert (
        t.run("publish hub", "publish", str(export), "--sink", "hf://acme/llm", env=hub_env).returncode == 0
    )
    assert (
        t.run("publish hub again", "publish", str(export), "--sink", "hf://acme/llm", env=hub_env).returncode
        == 0
    )
    for debug in ([], ["--debug"]):
        r = t.run(
            f"publish hub, bad token {debug}",
            *debug,
            "publish",
            str(export),
            "--sink",
            "hf://acme/other",
            env={**hub_env, "HF_TOKEN": BOGUS_HF_TOKEN},
        )
        assert r.returncode == 2 and "SinkAuthError" in r.stderr, r.stderr
    r = t.run(
        "publish hub, bad token in the URL",
        "publish",
        str(export),
        "--sink",
        f"hf://acme/other?token={URL_TOKEN}&max_attempts=1",
        env=hub_env,
    )
    assert r.returncode == 2 and "SinkAuthError" in r.stderr, r.stderr
    t.assert_clean()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


URLS = {
    "s3 userinfo": "s3://AKIASTAGERD:{pw}@bucket/prefix",
    "s3 query": "s3://bucket/prefix?secret={pw}",
    "ftp userinfo": "ftp://alice:{pw}@127.0.0.1:{port}/ckpt",
    "https userinfo and query": "https://alice:{pw}@127.0.0.1:{port}/ckpt?token={pw}",
    "hf endpoint userinfo": "hf://acme/llm?endpoint=http://alice:{pw}@127.0.0.1:{port}&max_attempts=1",
}


@pytest.mark.parametrize("url", list(URLS.values()), ids=list(URLS))
def test_a_secret_in_a_sink_url_never_shows(step_dir, tmp_path, url):
    t = Transcript(STATIC)
    export = _export(tmp_path, step_dir)
    sink = url.format(pw=URL_PASSWORD, port=_dead_port())
    env = secret_env(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{_dead_port()}", AWS_MAX_ATTEMPTS="1")

    for debug in ([], ["--debug"]):
        r = t.run(f"publish {debug}", *debug, "publish", str(export), "--sink", sink, env=env, timeout=120)
        assert r.returncode != 0
    t.assert_clean()


# ---------------------------------------------------------------------------------------------- daemon


def test_watch_status_and_journal_never_hold_a_secret(s3, hub, step_dir, tmp_path):  # noqa: F811
    t = Transcript({**STATIC, "Hub write token": hub.token})
    root = tmp_path / "root"
    root.mkdir()
    step_dir.rename(root / step_dir.name)
    env = secret_env(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token)
    failing = f"hf://acme/denied?token={URL_TOKEN}&max_attempts=1"
    sinks = ["--sink", s3.url(), "--sink", "hf://acme/llm", "--sink", failing]

    r = t.run(
        "watch --once",
        "watch",
        str(root),
        *sinks,
        "--once",
        "--max-attempts",
        "1",
        *FAST_WATCH,
        "--metrics-port",
        "0",
        env=env,
    )

    assert r.returncode != 0  # the failing sink's lane waits for a good token
    assert "published" in r.stderr and "SinkAuthError" in r.stdout + r.stderr
    published = s3.keys()
    assert any(k.endswith(layout.MANIFEST_NAME) for k in published)
    assert t.run("status", "status", str(root), env=env).returncode == 0
    status = t.run("status --json", "status", str(root), "--json", "--all", env=env)
    doc = json.loads(status.stdout)
    lanes = {ln["sink"]: ln["state"] for s in doc["steps"] for ln in s["lanes"]}
    assert sorted(lanes.values()) == ["failed", "published", "published"], lanes
    t.add_tree("state", root / layout.STATE_DIR)
    # what the sinks hold: manifests, claims, leases and data on S3; the Hub's files and commit messages
    for key in published:
        t.add(f"s3/{key}", s3.get(key))
    for repo in hub.store.repos.values():
        for c in repo.commits.values():
            t.add(f"hub/{repo.repo_id}@{c.oid}", f"{c.title}\n{c.message}")
            for path, blob in c.tree.items():
                t.add(f"hub/{repo.repo_id}/{path}", blob.content or b"")
    t.add_tree("hub-lfs", hub.store.lfs_dir)
    assert any("hub/acme/llm/" in label for label, _ in t.pieces)
    t.assert_clean()


def _listening(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


def test_metrics_listen_on_loopback_and_hold_no_secret(step_dir, tmp_path):
    t = Transcript(STATIC)
    root = tmp_path / "root"
    root.mkdir()
    step_dir.rename(root / step_dir.name)
    port = _dead_port()
    sink = f"file://{tmp_path / 'published'}"
    env = secret_env(AWS_SESSION_TOKEN=SESSION_TOKEN)
    # a second sink whose token is in its URL: its lanes are metric labels
    hub = f"hf://acme/llm?token={URL_TOKEN}&endpoint=http://127.0.0.1:{_dead_port()}&max_attempts=1"
    flags = ["--sink", sink, "--sink", hub, "--metrics-port", str(port), *FAST_WATCH]
    proc = start_cli(["watch", root, *flags], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "published").exists():
            assert proc.poll() is None, "the daemon exited"
            time.sleep(0.2)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read()
        listening = _listening(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    t.add("metrics", metrics)
    t.add("healthz", health)
    t.add("watch stdout", out)
    t.add("watch stderr", err)
    assert b"stagerd" in metrics and b'sink="hf://acme/llm"' in metrics and "status" in json.loads(health)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 only
    t.assert_clean()


MALFORMED = {  # urlsplit refuses each ("Invalid IPv6 URL"): the password must be masked without it
    "--sink": ["--sink", "https://alice:{pw}@[::1/ckpt"],
    "--sink-retention": ["--sink", "file://{out}", "--sink-retention", "https://alice:{pw}@[::1/x=last=1"],
}


@pytest.mark.parametrize("flags", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_secret_in_a_url_no_parser_reads_never_shows(tmp_path, flags):
    """Before: `--sink` quoted the URL whole in its ConfigError, and `--sink-retention` died with a
    ValueError traceback out of the redaction itself."""
    t = Transcript(STATIC)
    args = [f.format(pw=URL_PASSWORD, out=tmp_path / "out") for f in flags]
    for debug in ([], ["--debug"]):
        r = t.run(f"watch {debug}", *debug, "watch", str(tmp_path), *args, "--once", env=secret_env())
        assert r.returncode == 2 and "ConfigError" in r.stderr, r.stderr
        assert debug or "Traceback" not in r.stderr, r.stderr
    t.assert_clean()
