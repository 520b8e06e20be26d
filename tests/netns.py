"""Throw-away "hosts" for multi-host tests: Linux network namespaces joined by a bridge.

::

    with netns_hosts(3) as lab:               # skips the test where namespaces are refused
        server = lab.popen(lab.hosts[0], [sys.executable, "-m", ...])
        ...                                   # lab.hosts[i].ip is reachable from every host

Layout: one namespace per host plus one holding the bridge ``br0``; host ``i`` gets a veth pair
``eth0`` (in the host) <-> ``p<i>`` (in the bridge namespace, enslaved to ``br0``), an address
``10.213.<random>.<10+i>/24`` and loopback up. Nothing is created in the caller's own network
namespace, so the subnet cannot collide with the machine's real networks, and the namespace names
carry the pid and a random token so parallel runs never clash. Everything is torn down in
``finally``: processes still running in the namespaces are killed, then the namespaces are
deleted (which deletes their veths and the bridge).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

IP_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """An ``ip`` command failed after namespaces were shown to work (a real failure)."""


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    ip: str


@dataclass
class NetnsLab:
    hosts: list[Host]
    bridge_ns: str
    subnet: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, host: Host, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; killed at teardown if still running."""
        proc = popen_in(host.name, argv, **kw)
        self.procs.append(proc)
        return proc

    @property
    def namespaces(self) -> list[str]:
        return [h.name for h in self.hosts] + [self.bridge_ns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): "
                         f"{proc.stderr.strip()}")
    return proc


def popen_in(ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen`` of ``argv`` inside network namespace ``ns`` (``ip netns exec``
    execs the command, so the Popen's pid is the command's own pid and signals reach it)."""
    return subprocess.Popen(["ip", "netns", "exec", ns, *map(str, argv)], **kw)


def list_namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all_in(lab: NetnsLab) -> None:
    for proc in lab.procs:
        if proc.poll() is None:
            proc.kill()
    for proc in lab.procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    # Anything still living in our namespaces was started (directly or not) by this lab.
    for ns in lab.namespaces:
        for pid in _ns_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _refused(stderr: str) -> bool:
    s = stderr.lower()
    return any(k in s for k in ("operation not permitted", "permission denied",
                                "not supported", "unknown device type", "no such file",
                                "read-only file system"))


@contextmanager
def netns_hosts(n: int, prefix: str = "mfgt") -> Iterator[NetnsLab]:
    """``n`` hosts on one private /24, each in its own network namespace (see module doc)."""
    if shutil.which("ip") is None:
        pytest.skip("multi-host test needs iproute2's `ip` command to create network namespaces")
    tag = f"{prefix}{os.getpid()}-{secrets.token_hex(2)}"
    octet = secrets.randbelow(256)
    subnet = f"10.213.{octet}.0/24"
    lab = NetnsLab([Host(f"{tag}-h{i}", f"10.213.{octet}.{10 + i}") for i in range(n)],
                   f"{tag}-br", subnet)
    created: list[str] = []
    try:
        probe = _ip("netns", "add", lab.bridge_ns, check=False)
        if probe.returncode != 0:
            msg = probe.stderr.strip()
            if _refused(msg):
                pytest.skip(f"this machine refuses network namespaces (`ip netns add` needs "
                            f"root or CAP_NET_ADMIN): {msg}")
            raise NetnsError(f"`ip netns add {lab.bridge_ns}` failed: {msg}")
        created.append(lab.bridge_ns)
        br = _ip("-n", lab.bridge_ns, "link", "add", "br0", "type", "bridge", check=False)
        if br.returncode != 0:
            if _refused(br.stderr):
                pytest.skip(f"this kernel refuses a Linux bridge in a namespace: "
                            f"{br.stderr.strip()}")
            raise NetnsError(f"cannot create bridge: {br.stderr.strip()}")
        _ip("-n", lab.bridge_ns, "link", "set", "br0", "up")
        _ip("-n", lab.bridge_ns, "link", "set", "lo", "up")
        for i, host in enumerate(lab.hosts):
            _ip("netns", "add", host.name)
            created.append(host.name)
            port = f"p{i}"
            veth = _ip("link", "add", "eth0", "netns", host.name, "type", "veth", "peer",
                       "name", port, "netns", lab.bridge_ns, check=False)
            if veth.returncode != 0:
                if _refused(veth.stderr):
                    pytest.skip(f"this kernel refuses veth pairs: {veth.stderr.strip()}")
                raise NetnsError(f"cannot create veth pair: {veth.stderr.strip()}")
            _ip("-n", lab.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", lab.bridge_ns, "link", "set", port, "up")
            _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
        _wait_links_up(lab)
        yield lab
    finally:
        _kill_all_in(lab)
        for ns in reversed(created):
            _ip("netns", "del", ns, check=False)


def _wait_links_up(lab: NetnsLab, timeout_s: float = 10.0) -> None:
    """Bridge ports pass traffic once they leave the 'listening' state (no STP: at once,
    but the link state settles asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [_ip("-n", h.name, "-o", "link", "show", "eth0").stdout for h in lab.hosts]
        if all("state UP" in s or "LOWER_UP" in s for s in states):
            return
        if time.monotonic() > deadline:
            raise NetnsError(f"veth links not up within {timeout_s}s: {states}")
        time.sleep(0.05)
