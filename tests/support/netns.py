"""Separate hosts on one Linux machine: network namespaces on a private bridge.

    with isolated_network("n1", "n2") as net:
        net.host.address                 # the host's own side, e.g. 10.173.41.1
        n1 = net.hosts["n1"]             # its own namespace, e.g. 10.173.41.2
        subprocess.Popen(n1.argv(["python", "-m", "http.server", "--bind", n1.address]))
        net.remove("n1")                 # the machine is lost: its processes and namespace go
        net.restore("n1")                # a new namespace, the same address (and MAC)

Layout. One bridge ``sxh-<run>-br`` in the host's namespace carries the first address of a
private /24 picked at random in 10.128.0.0-10.239.255.0, one not overlapping any address or
route the host already has (``ip -o -4 addr``, ``ip -4 route show table all``). Each namespace
``sxh-<run>-<name>`` gets one veth pair, its host end ``sxh-<run>-v<i>`` on the bridge, its
own end ``eth0`` with the next address and a MAC derived from that address (so a restored
host answers ARP as before), and its loopback up. The bridge has a fixed MAC too: by default
it takes its ports' lowest, so losing a host would change it under everyone's ARP cache.
Nothing else: no default route, no forwarding, no NAT, so a namespace reaches only the
addresses this module created.

The host's loopback is not reachable from a namespace, so whatever must reach services bound
to 127.0.0.1 (PostgreSQL, Redis) runs in the host's namespace, bound to ``net.host.address``.

Teardown kills every process left in each namespace (``ip netns pids``), deletes the veth
pairs, the namespaces and the bridge, also when the block raised. A run writes
``/run/syshax-netns/<run>.json`` (its PID and start time, and the host-side process groups it
started, :meth:`Network.track`) before it creates anything and deletes it last;
:func:`sweep_leftovers` (run on entry) removes the namespaces, links and host-side processes
of runs whose owner is gone, so a test run killed with SIGKILL leaves nothing behind for
long, and never touches those of a run still going.

Needs root and iproute2; :func:`netns_problem` says why not.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

PREFIX = "sxh"
REGISTRY = Path("/run/syshax-netns")
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
RUN_OF = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})-")
# Second octets the random subnet is drawn from: clear of Podman's 10.88/10.89, Kubernetes'
# 10.96/12 and 10.244/16, and the 10.0/16 many labs use.
SECOND_OCTETS = range(128, 240)


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or namespaces cannot be used here."""


def netns_problem() -> str | None:
    """Why network namespaces cannot be used on this machine, or None when they can (a
    namespace is created and deleted to find out)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}-{secrets.token_hex(3)}-probe"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    return None


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    """One machine: a namespace of its own, or (``netns`` None) the host's own side."""

    name: str
    address: str
    netns: str | None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this machine (``ip netns exec`` keeps the PID: it execs)."""
        if self.netns is None:
            return list(argv)
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Processes in this machine's namespace (none for the host's own side)."""
        if self.netns is None:
            return []
        return [int(p) for p in ip("netns", "pids", self.netns, check=False).split()]


class Network:
    """A private /24 with the host's side on a bridge and one namespace per added host."""

    def __init__(self, run: str, subnet: ipaddress.IPv4Network, record: Path | None = None) -> None:
        self.run = run
        self.subnet = subnet
        self.record = record  # this run's registry file
        self.host_groups: list[tuple[int, float]] = []  # (pgid, its leader's start time)
        self.bridge = f"{PREFIX}-{run}-br"
        gateway = str(subnet.network_address + 1)
        self.host = Host("host", gateway, None)
        self.hosts: dict[str, Host] = {}
        self.slots: dict[str, int] = {}  # name -> index; kept after remove() for restore()

    # ----------------------------------------------------------------- set-up

    def write_record(self) -> None:
        if self.record is None:
            return
        me = psutil.Process()
        owner = {"pid": me.pid, "started": me.create_time(), "host_groups": self.host_groups}
        self.record.write_text(json.dumps(owner))

    def track(self, pid: int) -> None:
        """Note a process group this run started on the host's side (the control plane):
        should this run die without its teardown, :func:`sweep_leftovers` kills it too."""
        with contextlib.suppress(psutil.Error):
            self.host_groups.append((pid, psutil.Process(pid).create_time()))
            self.write_record()

    def open(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        # A bridge takes the lowest MAC of its ports unless given one: removing a host's port
        # would change it, and every other host's ARP entry for the host's side would go stale.
        ip("link", "set", self.bridge, "address", mac_of(self.host.address))
        ip("addr", "add", f"{self.host.address}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        """A new machine ``name`` with the next free address."""
        if not NAME.match(name):
            raise NetnsError(f"host name {name!r} must match {NAME.pattern}")
        if name in self.slots:
            raise NetnsError(f"host {name!r} exists; restore() brings a removed one back")
        self.slots[name] = len(self.slots) + 2  # .1 is the host's side
        return self._create(name)

    def restore(self, name: str) -> Host:
        """A fresh namespace for ``name`` (removed before) with the same address and MAC."""
        if name in self.hosts:
            raise NetnsError(f"host {name!r} is still there")
        return self._create(name)

    def _create(self, name: str) -> Host:
        index = self.slots[name]
        address = self.subnet.network_address + index
        if address >= self.subnet.broadcast_address:
            raise NetnsError(f"subnet {self.subnet} is full")
        netns, veth = f"{PREFIX}-{self.run}-{name}", self.veth(name)
        mac = mac_of(str(address))
        host = Host(name, str(address), netns)
        self.hosts[name] = host  # from here on, close() cleans it up
        ip("netns", "add", netns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "link", "set", "eth0", "address", mac)
        ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        return host

    def veth(self, name: str) -> str:
        return f"{PREFIX}-{self.run}-v{self.slots[name]}"

    def cut(self, name: str) -> None:
        """Pull ``name``'s cable: its bridge port goes down, so from now on the others see a
        host that went silent (no RST, no ICMP), as when a machine loses power."""
        ip("link", "set", self.veth(name), "down")

    # --------------------------------------------------------------- tear-down

    def remove(self, name: str) -> None:
        """The machine is lost: SIGKILL everything in its namespace, delete its links and it."""
        host = self.hosts.pop(name)
        assert host.netns is not None
        kill_all(host)
        ip("link", "del", self.veth(name), check=False)
        ip("netns", "del", host.netns, check=False)
        if host.netns in netns_names():
            raise NetnsError(f"namespace {host.netns} is still there after `ip netns del`")

    def close(self) -> None:
        errors: list[str] = []
        for name in list(self.hosts):
            try:
                self.remove(name)
            except (NetnsError, subprocess.SubprocessError) as exc:
                errors.append(str(exc))
        ip("link", "del", self.bridge, check=False)
        left = [n for n in netns_names() if n.startswith(f"{PREFIX}-{self.run}-")]
        left += [link for link in link_names() if link.startswith(f"{PREFIX}-{self.run}-")]
        if left:
            errors.append(f"left behind: {', '.join(left)}")
        if errors:
            raise NetnsError("network teardown: " + "; ".join(errors))


def mac_of(address: str) -> str:
    """A locally administered MAC made of the IPv4 address, stable across a restore."""
    return "02:00:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)


def kill_all(host: Host, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``host``'s namespace until none is left (a dying launcher
    may fork a replacement engine between two passes)."""
    deadline = time.monotonic() + timeout
    while pids := host.pids():
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in {host.netns} survived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def netns_names() -> list[str]:
    # `ip netns list` prints "name (id: 3)" for namespaces that have a peer id.
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def link_names() -> list[str]:
    out = []
    for line in ip("-o", "link", "show").splitlines():
        # "12: sxh-ab12cd-v2@if3: <BROADCAST,...>"
        parts = line.split(":", 2)
        if len(parts) > 1:
            out.append(parts[1].strip().split("@")[0])
    return out


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address in or a route to (except the default)."""
    nets = []
    for line in ip("-o", "-4", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        fields = line.split()
        if fields and fields[0] in {"local", "broadcast", "unicast", "multicast", "anycast"}:
            fields = fields[1:]
        if not fields or fields[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(fields[0], strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def pick_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    rng = rng or random.SystemRandom()
    used = used_networks()
    for _ in range(200):
        subnet = ipaddress.IPv4Network(f"10.{rng.choice(SECOND_OCTETS)}.{rng.randrange(256)}.0/24")
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetnsError("no free /24 in 10.128.0.0-10.239.255.255")


# ----------------------------------------------------------------- ownership and sweeping


def _running(pid: int, started: float) -> bool:
    """Whether ``pid`` is the process that started at ``started`` (not a recycled PID)."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def _owner(record: Path) -> dict[str, Any]:
    try:
        owner = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _owner_alive(owner: dict[str, Any]) -> bool:
    try:
        return _running(int(owner["pid"]), float(owner["started"]))
    except (KeyError, TypeError, ValueError):
        return False


def sweep_leftovers() -> list[str]:
    """Delete the namespaces and links of earlier runs whose owner process is gone, and kill
    the host-side process groups they noted (:meth:`Network.track`).

    A run is live while its registry file names a running process. Without a registry file a
    run's namespaces are swept only when older than this process, so a run that is just
    starting is never touched. Returns what was removed.
    """
    owners = {p.stem: _owner(p) for p in REGISTRY.glob("*.json")}
    live = {run for run, owner in owners.items() if _owner_alive(owner)}
    started = psutil.Process().create_time()
    removed: list[str] = []
    for run, owner in owners.items():
        if run in live:
            continue
        for pgid, leader_started in owner.get("host_groups", []):
            if _running(int(pgid), float(leader_started)):
                with contextlib.suppress(OSError):
                    os.killpg(int(pgid), signal.SIGKILL)
                    removed.append(f"process group {pgid}")
    for netns in netns_names():
        match = RUN_OF.match(netns)
        if not match or match.group(1) in live:
            continue
        with contextlib.suppress(OSError):
            if (REGISTRY / f"{match.group(1)}.json").exists() or (
                Path("/run/netns", netns).stat().st_mtime < started
            ):
                kill_all(Host(netns, "", netns))
                ip("netns", "del", netns, check=False)
                removed.append(netns)
    for link in link_names():
        match = RUN_OF.match(link)
        if match and match.group(1) not in live:
            ip("link", "del", link, check=False)
            removed.append(link)
    for record in REGISTRY.glob("*.json"):
        if record.stem not in live:
            record.unlink(missing_ok=True)
    return removed


@contextmanager
def isolated_network(*names: str) -> Iterator[Network]:
    """A private network with one namespace per name; everything is gone afterwards."""
    problem = netns_problem()
    if problem:
        raise NetnsError(problem)
    sweep_leftovers()
    run = secrets.token_hex(3)
    REGISTRY.mkdir(parents=True, exist_ok=True)
    record = REGISTRY / f"{run}.json"
    network = Network(run, pick_subnet(), record)
    network.write_record()  # before anything exists that a sweep could take for a leftover
    try:
        network.open()
        for name in names:
            network.add(name)
        yield network
    finally:
        try:
            network.close()
        finally:
            record.unlink(missing_ok=True)


__all__ = [
    "Host",
    "NetnsError",
    "Network",
    "isolated_network",
    "netns_problem",
    "pick_subnet",
    "sweep_leftovers",
]
