"""A node's address is a host name or an IP literal, and every engine URL is built from one by
one function, IPv6 in brackets (common/hosts.py)."""

from __future__ import annotations

import pytest

from agents.runtimes.dockerapi import _endpoint
from common.engine_spec import EngineSpec, SpecError
from common.hosts import HostError, check_host, http_url, is_host, is_http_url

GOOD = ["10.0.0.5", "gpu-01", "gpu-01.lab.example", "localhost", "2001:db8::5", "::1", "1-2"]
BAD = [
    "10.0.0.5:22#",  # the reproduction: http://10.0.0.5:22#:7001 is 10.0.0.5 port 22
    "10.0.0.5:22",
    "evil.example/x",
    "user@evil.example",
    "http://evil.example",
    "evil.example#",
    "evil.example?",
    "a b",
    "[2001:db8::5]",  # brackets belong to URLs, not to addresses
    "fe80::1%eth0",  # a zone is one machine's interface
    "127.1",  # inet_aton's short forms: addresses dressed as names
    "2130706433",
    "0x7f000001",
    "10.0.0",
    "010.0.0.1",
    "-gpu.example",
    "gpu-.example",
    "gpu..example",
    "gpu.example.",
    "g_pu.example",
    "x" * 64 + ".example",
    ".".join(["abcdefgh"] * 29),  # 260 characters
    "",
    "gpü.example",
]


@pytest.mark.parametrize("value", GOOD)
def test_a_host_name_or_an_ip_literal_is_an_address(value: str) -> None:
    assert check_host(value) == value and is_host(value)


@pytest.mark.parametrize("value", BAD)
def test_anything_else_is_refused_with_the_rule(value: str) -> None:
    with pytest.raises(HostError, match="must be a host name"):
        check_host(value)
    assert not is_host(value)


def test_engine_urls_bracket_ipv6_and_are_checked() -> None:
    assert http_url("10.0.0.5", 7001) == "http://10.0.0.5:7001"
    assert http_url("2001:db8::5", 7001) == "http://[2001:db8::5]:7001"
    assert http_url("gpu-01.lab", 80) == "http://gpu-01.lab:80"
    for host, port in (("10.0.0.5:22#", 7001), ("10.0.0.5", 0), ("10.0.0.5", 65536)):
        with pytest.raises(HostError):
            http_url(host, port)


def test_only_a_url_http_url_builds_passes_as_one() -> None:
    for url in ("http://10.0.0.5:7001", "http://[2001:db8::5]:7001", "http://gpu-01:80"):
        assert is_http_url(url), url
    for url in (
        "http://10.0.0.5:22#:7001",
        "http://2001:db8::5:7001",
        "https://10.0.0.5:7001",
        "http://10.0.0.5:7001/",
        "http://10.0.0.5",
        "http://10.0.0.5:07001",
        "http://user@10.0.0.5:7001",
        "",
    ):
        assert not is_http_url(url), url


def test_the_agent_takes_only_a_host_in_a_spec_and_brackets_its_endpoint() -> None:
    spec = EngineSpec.from_dict({"command": ["sim"], "host": "2001:db8::5", "port": 7001})
    assert spec.endpoint == "http://[2001:db8::5]:7001"
    with pytest.raises(SpecError, match=r"spec\.host"):
        EngineSpec.from_dict({"command": ["sim"], "host": "10.0.0.5:22#", "port": 7001})
    # A container's endpoint, rebuilt from its labels after an agent restart.
    assert _endpoint("2001:db8::5", "7001") == "http://[2001:db8::5]:7001"
    assert _endpoint("10.0.0.5:22#", "7001") is None and _endpoint("10.0.0.5", "0") is None
