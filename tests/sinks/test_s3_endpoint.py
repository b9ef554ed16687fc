"""A malformed S3 endpoint (no scheme, not http) is a ConfigError naming where it came from, in every
command, before a client is made: never a traceback, never an outage to retry."""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError
from stagerd.sinks.s3.backend import S3Backend
from tests.cli_helpers import run_cli
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

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


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://minio:s3cr3t-pw@minio:9000", "'http://minio:***@minio:9000' carries credentials"),
        ("http://AKIAKEYONLY@minio:9000", "'http://***@minio:9000' carries credentials"),
        ("ftp://minio:s3cr3t-pw@minio:9000", "'ftp://minio:***@minio:9000' has the scheme ftp://"),
    ],
)
def test_credentials_in_an_endpoint_are_refused_and_never_shown(monkeypatch, url, named):
    """botocore refuses every request to an endpoint with USER:PASSWORD@ in it (it would read as a sink
    down for ever), and the message that names the endpoint must not carry the password."""
    for k, v in {**_KEYS, "AWS_ENDPOINT_URL": url}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        _open({})
    text = f"{e.value.message} {e.value.hint}"
    assert named in text
    assert "s3cr3t-pw" not in text and "AKIAKEYONLY" not in text


def test_a_good_endpoint_opens(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    _open({})  # no request is made: nothing to reach


# botocore's two places for an endpoint in the config file: the profile's own, and its services section's
# (which comes first: the profile's own is not used, nor checked, where that one is set)
_PROFILE = "[default]\nendpoint_url = {url}\n"
_SERVICES = (
    "[profile p]\nendpoint_url = http://unused:1\nservices = store\n"
    "[services store]\ns3 =\n  endpoint_url = {url}\n"
)
_IGNORE = "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"


def _config_file(monkeypatch, path, text: str) -> None:
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", _IGNORE):
        monkeypatch.delenv(var, raising=False)
    path.write_text(text)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(path))


@pytest.mark.parametrize(
    ("text", "opts", "named"),
    [
        (_PROFILE, {}, "the endpoint_url of profile default='minio:9000' has no scheme"),
        (_SERVICES, {"profile": "p"}, "the s3 endpoint_url of [services store] (profile p's services)="),
    ],
    ids=["profile", "services"],
)
def test_a_bad_endpoint_in_the_config_file_names_the_file_and_profile(
    monkeypatch, tmp_path, text, opts, named
):
    _config_file(monkeypatch, tmp_path / "config", text.format(url="minio:9000"))
    for k, v in _KEYS.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        _open(opts)
    assert e.value.path == str(tmp_path / "config")
    assert named in e.value.message
    assert "give the scheme: http://minio:9000" in e.value.hint
    monkeypatch.setenv(_IGNORE, "true")  # as botocore: the file is not read
    _open(opts)


@pytest.mark.parametrize("text", [_PROFILE, _SERVICES], ids=["profile", "services"])
def test_a_good_endpoint_in_the_config_file_is_the_one_used(s3, monkeypatch, tmp_path, text):  # noqa: F811
    _config_file(monkeypatch, tmp_path / "config", text.format(url=s3.server.endpoint))
    if text is _SERVICES:
        monkeypatch.setenv("AWS_PROFILE", "p")
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=16 << 20, max_concurrency=2, checksum="CRC32")
    try:
        b.write("x", b"through the config file's endpoint")
    finally:
        b.close()
    assert s3.get("ckpt/x") == b"through the config file's endpoint"
    assert s3.proxy.log  # through the proxy: the endpoint the file names


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
