"""An IPv6 literal host (`ftp://[::1]/x`) is a host like any other: parsed, placed and opened, while a real
fsspec chain (`simplecache::s3://...`) is still refused. ftp is the host-based store fsspec ships without
extra packages; sftp needs paramiko, so here its URL is only parsed."""

from __future__ import annotations

import socket

import pytest

from stagerd.errors import ConfigError, SinkError
from stagerd.sinks.backends import open_backend
from stagerd.sinks.own_places import check_sinks
from stagerd.sinks.places import place_of
from stagerd.sinks.urls import SinkKind, parse_sink_url


@pytest.mark.parametrize(
    ("url", "location"),
    [
        ("ftp://[::1]/x", "[::1]"),
        ("ftp://user@[::1]:2222/x", "user@[::1]:2222"),
        ("ftp://[fe80::1:2]/x/y", "[fe80::1:2]"),
        ("ftp://[::ffff:127.0.0.1]:21/x", "[::ffff:127.0.0.1]:21"),
    ],
)
def test_an_ipv6_host_is_accepted(url: str, location: str) -> None:
    sink = parse_sink_url(url)
    assert (sink.kind, sink.protocol, sink.location) == (SinkKind.FSSPEC, "ftp", location)


@pytest.mark.parametrize("url", ["sftp://[::1]/x", "sftp://user@[::1]:2222/x"])
def test_an_sftp_ipv6_host_is_no_chain(url: str) -> None:
    try:
        parse_sink_url(url)
    except ConfigError as e:  # without paramiko: the package is named, not a chain
        assert "chains" not in e.message and "paramiko" in e.message, e.message


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("simplecache::s3://b/x", "chains fsspec protocols"),
        ("ftp://[::1]/x::memory://y", "chains fsspec protocols"),
        ("simplecache::ftp://[::1]/x", "chains fsspec protocols"),
        ("ftp://[zz]/x", "malformed host"),
        ("ftp://[::1/x", "malformed host"),
        ("ftp://[zz::1]/x", "malformed host"),
        ("ftp://[1.2.3.4]/x", "malformed host"),
        ("ftp://[::1]/run[1]", "glob character"),
    ],
)
def test_chains_bad_hosts_and_patterns_are_still_refused(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_sink_url(url)
    assert why in e.value.message, e.value.message


def test_two_spellings_of_one_ipv6_host_are_one_place() -> None:
    assert place_of("ftp://[0:0::1]/x/") == place_of("ftp://[::1]/x")
    assert place_of("ftp://u@[::0001]:21/x") == place_of("ftp://u@[::1]:21/x")
    assert place_of("ftp://[::2]/x") != place_of("ftp://[::1]/x")
    with pytest.raises(ConfigError, match="same place"):
        check_sinks(["ftp://[::1]/run", "ftp://[0:0:0:0:0:0:0:1]/run"])
    with pytest.raises(ConfigError, match="lies inside"):
        check_sinks(["ftp://[::1]/run", "ftp://[::0:1]/run/step-00000001"])
    check_sinks(["ftp://[::1]/run", "ftp://[::1]/other"])


def test_an_ipv6_host_is_dialled_at_its_address() -> None:
    with socket.socket(socket.AF_INET6) as s:  # a port on ::1 that nothing listens on
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SinkError) as e:
        open_backend(f"ftp://[::1]:{port}/x", {}, part_size=1 << 20, max_concurrency=1, checksum="CRC32")
    # refused by ::1 itself: not a parse error, not a lookup of the name "[::1]"
    assert "ConnectionRefusedError" in e.value.message, e.value.message
