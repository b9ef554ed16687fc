"""A malformed S3 endpoint (no scheme, not http) is a ConfigError naming where it came from, in every
command, before a client is made: never a traceback, never an outage to retry."""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError
from stagerd.sinks.s3.backend import S3Backend
from tests.cli_helpers import run_cli

_KEYS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}


def _open(opts: dict) -> S3Backend:
    return S3Backend.open("s3://bkt/p", opts, part_size=16 << 20, max_concurrency=2, checksum="CRC32")


@pytest.mark.parametrize(
    ("env", "opts", "named"),
    [
        ({"AWS_ENDPOINT_URL": "minio:9000"}, {}, "AWS_ENDPOINT_URL='minio:9000' has no scheme"),
        ({"AWS_ENDPOINT_URL": "ftp://x"}, {}, "AWS_ENDPOINT_URL='ftp://x' has the scheme ftp://"),
        ({"AWS_ENDPOINT_URL_S3": "minio:9000"}, {}, "AWS_ENDPOINT_URL_S3="),
        ({}, {"endpoint_url": "minio:9000"}, "the storage option endpoint_url='minio:9000'"),
    ],
)
def test_a_bad_endpoint_is_refused_when_the_store_opens(monkeypatch, env, opts, named):
    for k, v in {**_KEYS, **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        _open(opts)
    assert named in e.value.message
    assert "http://" in e.value.hint


def test_a_good_endpoint_opens(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    _open({})  # no request is made: nothing to reach


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "s3://bkt/p", "--keep-last", "1", "--dry-run"],
        ["restore", "s3://bkt/p", "{tmp}/n"],
    ],
    ids=["prune", "restore"],
)
def test_every_command_names_the_endpoint_without_a_traceback(tmp_path, args):
    r = run_cli(
        [a.format(tmp=tmp_path) for a in args], env={**_KEYS, "AWS_ENDPOINT_URL": "minio:9000"}, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "ConfigError: AWS_ENDPOINT_URL='minio:9000' has no scheme" in r.stderr
    assert "give the scheme: http://minio:9000" in r.stderr
    assert not (tmp_path / "n").exists()
