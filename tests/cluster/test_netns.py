"""The separate-hosts harness itself (tests/support/netns.py): what a namespace can reach,
losing and restoring a host, and that nothing is left behind, even by a run that died."""

from __future__ import annotations

import ipaddress
import json
import secrets
import subprocess
import sys
from pathlib import Path

from tests.cluster.conftest import require_netns
from tests.support.netns import (
    REGISTRY,
    Host,
    Network,
    ip,
    isolated_network,
    link_names,
    netns_names,
    sweep_leftovers,
    used_networks,
)

# Accepts one connection on (address, port) and exits; prints "listening" once bound.
LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("listening", flush=True); s.settimeout(10); s.accept()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def connect(src: Host, address: str, port: int) -> str:
    argv = src.argv([sys.executable, "-c", CONNECT, address, str(port)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()


def listening(host: Host, port: int) -> subprocess.Popen[str]:
    argv = host.argv([sys.executable, "-c", LISTEN, host.address, str(port)])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def test_hosts_reach_each_other_and_nothing_else(network: Network) -> None:
    a, b = network.add("a"), network.add("b")
    assert network.subnet.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    assert len({network.host.address, a.address, b.address}) == 3
    # Only the private subnet: no default route, nowhere else to go.
    routes = subprocess.run(a.argv(["ip", "-4", "route"]), capture_output=True, text=True)
    assert routes.stdout.split()[0] == str(network.subnet), routes.stdout
    assert "default" not in routes.stdout
    # Host to namespace, and namespace to namespace across the bridge. The latter fails
    # where br_netfilter hands bridged traffic to an iptables FORWARD chain that drops it.
    server = listening(b, 9001)
    assert connect(a, b.address, 9001) == "connected", (
        "a namespace cannot reach another across the bridge: with "
        "/proc/sys/net/bridge/bridge-nf-call-iptables = 1, iptables' FORWARD chain must "
        "accept traffic on the sxh-* bridges"
    )
    server.wait(5)
    # The host's loopback services (PostgreSQL, Redis) are not visible from a namespace.
    assert connect(a, "127.0.0.1", 5432) != "connected"


def test_a_lost_host_takes_its_processes_and_comes_back_with_its_address(
    network: Network,
) -> None:
    a = network.add("a")
    server = listening(a, 9002)
    mac = ip("-n", str(a.netns), "link", "show", "eth0").split("link/ether")[1].split()[0]
    network.remove("a")
    assert server.wait(5) == -9  # SIGKILLed with its machine
    assert a.netns not in netns_names()
    back = network.restore("a")
    assert (back.address, back.netns) == (a.address, a.netns)
    assert mac in ip("-n", str(back.netns), "link", "show", "eth0")  # ARP caches stay right
    assert connect(network.host, back.address, 9003) == "ConnectionRefusedError"


def test_nothing_is_left_afterwards_and_a_dead_runs_leftovers_are_swept() -> None:
    require_netns()
    with isolated_network("a", "b") as net:
        run = net.run
        assert net.subnet in used_networks()
    assert not [n for n in netns_names() + link_names() if n.startswith(f"sxh-{run}-")]

    # A run that died: its registry names a process that is gone.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = secrets.token_hex(3)
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / f"{stale}.json").write_text(json.dumps({"pid": dead.pid, "started": 0.0}))
    ip("netns", "add", f"sxh-{stale}-x")
    ip("link", "add", f"sxh-{stale}-br", "type", "bridge")
    # A namespace of no known run that is newer than this process may be a run starting up.
    young = secrets.token_hex(3)
    ip("netns", "add", f"sxh-{young}-x")
    try:
        with isolated_network("c") as live:  # sweeps on entry; a live run is never swept
            assert f"sxh-{stale}-x" not in netns_names()
            assert f"sxh-{stale}-br" not in link_names()
            assert not Path(REGISTRY / f"{stale}.json").exists()
            assert f"sxh-{young}-x" in netns_names()
            sweep_leftovers()
            assert live.hosts["c"].netns in netns_names()
    finally:
        ip("netns", "del", f"sxh-{young}-x", check=False)
        ip("netns", "del", f"sxh-{stale}-x", check=False)
        ip("link", "del", f"sxh-{stale}-br", check=False)
