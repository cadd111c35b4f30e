"""Emulated interconnects between tensor-parallel ranks on one machine.

``EmulatedLinks(world, LinkSpec.parse("200mbit"))`` gives every rank its own network
namespace, joined to a bridge (in a namespace of its own) by a veth pair whose two
directions are shaped by ``tc``: the token-bucket filter (tbf) sets the rate, netem a
one-way delay where the kernel has it. Gloo then runs over TCP between the namespaces'
addresses, so a collective costs what its bytes cost on a link of that rate, not the
loopback's fixed latency. Nothing outside the namespaces made here is touched: the
addresses live only inside them, and ``close`` (also at exit, on failure and after a
signal the caller turns into ``SystemExit``) deletes them all; namespaces left by a
process that was killed outright are removed by the next ``EmulatedLinks``.

Needs root and iproute2 (``ip``, ``tc``); without them, one ``UserError`` line.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsl.errors import UserError

INTERFACE = "dl0"  # the rank's end of its veth pair, the same name in every namespace
PREFIX = "deinfer-"  # every namespace made here: deinfer-<pid>-<tag>-{hub,r0,r1,...}
NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000

_RATE_UNITS = {  # tc's units: "bit" suffixes are bits/s, "bps" suffixes bytes/s (SI)
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class LinkSpec:
    """A link's rate (each direction, each rank) and one-way latency rank to rank."""

    rate_bits_per_s: float
    latency_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``RATE[,LATENCY]`` in tc's units: ``200mbit``, ``1.5gbit``, ``25mbps`` (bytes/s),
        latency ``500us`` or ``2ms``."""
        rate_text, _, latency_text = text.strip().lower().partition(",")
        rate = _number_with_unit(rate_text, _RATE_UNITS, "rate", text)
        latency = (
            _number_with_unit(latency_text, _TIME_UNITS, "latency", text) if latency_text else 0
        )
        if rate <= 0:
            raise UserError(f"--link {text!r}: the rate must be positive")
        return cls(rate_bits_per_s=rate, latency_s=latency)

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bits_per_s / 8

    def describe(self) -> str:
        rate = f"{self.rate_bits_per_s / 1e6:g} Mbit/s"
        return rate + (f", {self.latency_s * 1e6:g} us one way" if self.latency_s else "")


def _number_with_unit(text: str, units: dict[str, float], what: str, whole: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text)
    if not match or match.group(2) not in units:
        raise UserError(
            f"--link {whole!r}: cannot read the {what} {text!r} "
            f"(a number and one of {', '.join(units)})"
        )
    return float(match.group(1)) * units[match.group(2)]


def check_tools() -> None:
    """Root and iproute2, or one line that says which is missing."""
    if os.geteuid() != 0:
        raise UserError("emulated links need root (network namespaces and tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"emulated links need iproute2: {' and '.join(missing)} not found")


def run_tool(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise UserError(f"{' '.join(argv)}: {reason[-1] if reason else 'failed'}")


def namespaces() -> list[str]:
    """Network namespaces made by any EmulatedLinks (live or left behind)."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(PREFIX))


def remove_stale() -> None:
    """Delete namespaces whose creating process is gone (it was killed outright)."""
    for name in namespaces():
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


class EmulatedLinks:
    """Namespaces, bridge and shaped veth pairs for ``world`` ranks (a context manager)."""

    def __init__(self, world: int, link: LinkSpec, subnet: str = "10.77.0") -> None:
        if not 2 <= world <= 250:
            raise UserError(f"emulated links join 2 to 250 ranks, found {world}")
        self.world, self.link, self.subnet = world, link, subnet
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.hub = f"{tag}-hub"
        self.ranks = [f"{tag}-r{r}" for r in range(world)]
        self._made: list[str] = []

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def namespace_path(self, rank: int) -> str:
        return str(NETNS_DIR / self.ranks[rank])

    def up(self) -> EmulatedLinks:
        check_tools()
        remove_stale()
        atexit.register(self.close)
        try:
            self._add_namespace(self.hub)
            run_tool("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            run_tool("ip", "-n", self.hub, "link", "set", "br0", "up")
            for rank in range(self.world):
                self._join(rank)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        run_tool("ip", "netns", "add", name)
        self._made.append(name)

    def _join(self, rank: int) -> None:
        ns, port = self.ranks[rank], f"p{rank}"
        self._add_namespace(ns)
        run_tool(
            "ip", "link", "add", INTERFACE, "netns", ns, "type", "veth",
            "peer", "name", port, "netns", self.hub,
        )  # fmt: skip
        run_tool("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        run_tool("ip", "-n", self.hub, "link", "set", port, "up")
        run_tool("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
        run_tool("ip", "-n", ns, "link", "set", INTERFACE, "up")
        run_tool("ip", "-n", ns, "link", "set", "lo", "up")
        self._shape(ns, INTERFACE)  # rank -> bridge
        self._shape(self.hub, port)  # bridge -> rank

    def _ends(self) -> list[tuple[str, str]]:
        """Every shaped egress: (namespace, device), both directions of each rank's link."""
        return [
            end
            for r in range(self.world)
            for end in ((self.ranks[r], INTERFACE), (self.hub, f"p{r}"))
        ]

    def reshape(self, link: LinkSpec) -> None:
        """Change every link to ``link`` in place (the ranks keep their connections)."""
        self.link = link
        for ns, dev in self._ends():
            run_tool("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")
            self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        """tbf at the link's rate on ``dev``'s egress, behind netem for half the one-way
        latency (a packet crosses two shaped ends). The burst is 0.5 ms of traffic (at
        least 16 KB) so small messages cannot outrun the rate; the queue holds 200 ms
        (at least 1 MB) so TCP is slowed, not dropped."""
        rate = self.link.rate_bits_per_s
        burst = max(16 << 10, int(rate / 8 * 5e-4))
        limit = max(1 << 20, int(rate / 8 * 0.2))
        tbf = ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]
        if not self.link.latency_s:
            run_tool("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)
            return
        delay = f"{self.link.latency_s / 2 * 1e6:.0f}us"
        try:
            run_tool("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", delay, "limit", "100000")  # fmt: skip
        except UserError:
            raise UserError(
                "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so a link latency "
                "cannot be emulated; give the rate alone (e.g. --link 200mbit)"
            ) from None
        run_tool("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)

    def close(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them)."""
        while self._made:
            name = self._made.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> EmulatedLinks:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()


def enter_namespace(path: str) -> None:
    """Move this process (its calling thread, and every thread it starts later) into the
    network namespace at ``path``, and point gloo at the namespace's interface. Call it
    first thing in a worker, before any socket or thread exists."""
    join_namespace(path)
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE


def join_namespace(path: str) -> None:
    """Move the calling thread (and the threads it starts later) into the network
    namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def probe_all_gather(nbytes: int, reps: int = 5) -> dict[str, float]:
    """Time all-gathers of ``nbytes`` per rank on the default group (after one warm-up):
    the median seconds, and the bytes each rank received per second."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from runtime.dist.comm import all_gather_flat

    world = dist.get_world_size()
    local = torch.zeros(max(1, nbytes // 4))
    out = torch.empty(world * local.numel())
    times = []
    for i in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        all_gather_flat(out, local)
        if i:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    received = (world - 1) * local.numel() * 4
    return {
        "bytes": float(local.numel() * 4),
        "seconds": seconds,
        "bytes_per_s": received / seconds,
    }
