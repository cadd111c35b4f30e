"""Emulated links: two ranks in their own network namespaces behind a shaped veth pair
run real collectives, the engine gives the same tokens behind them, and nothing is left
behind, also when a rank fails. No timing assertions: the rates are measured by the
benchmarks, not here."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from dsl.errors import UserError
from runtime.dist.emulated_link import PREFIX, EmulatedLinks, LinkSpec, namespaces
from runtime.dist.launcher import WorkerError, WorkerGroup, launch

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulated links need root and iproute2 (ip, tc)",
)


def _ours() -> list[str]:
    return [n for n in namespaces() if n.startswith(f"{PREFIX}{os.getpid()}-")]


def test_link_spec_parses_tc_units() -> None:
    assert LinkSpec.parse("200mbit") == LinkSpec(200e6, 0.0)
    assert LinkSpec.parse("1.5gbit,2ms") == LinkSpec(1.5e9, 2e-3)
    assert LinkSpec.parse("25mbps,500us").rate_bits_per_s == 200e6  # bytes/s, as tc
    for bad in ("fast", "200", "200mbit,soon", "0mbit", "-5mbit"):
        with pytest.raises(UserError, match="--link"):
            LinkSpec.parse(bad)


def _gather_and_where(rank: int, world: int) -> tuple[list[float], str, str]:
    local = torch.full((3,), float(rank + 1))
    out = torch.empty(3 * world)
    dist.all_gather_into_tensor(out, local)
    return out.tolist(), os.environ.get("GLOO_SOCKET_IFNAME", ""), os.readlink("/proc/self/ns/net")


@needs_netns
def test_all_gather_across_a_shaped_link_leaves_nothing_behind() -> None:
    host_ns = os.readlink("/proc/self/ns/net")
    with WorkerGroup(2, timeout_s=60, link=LinkSpec.parse("400mbit")) as group:
        made = _ours()
        assert len(made) == 3  # a hub with the bridge, one namespace per rank
        shaped = subprocess.run(
            ["tc", "-n", group.links.ranks[0], "qdisc", "show", "dev", "dl0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in shaped and "400Mbit" in shaped
        results = group.run(_gather_and_where)
        assert group.link_probe["bytes_per_s"] > 0
    assert [r[0] for r in results] == [[1.0] * 3 + [2.0] * 3] * 2
    assert {r[1] for r in results} == {"dl0"}  # gloo bound to the namespaces' interface
    spaces = {r[2] for r in results}
    assert len(spaces) == 2 and host_ns not in spaces  # each rank in its own namespace
    assert _ours() == []


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom")
    dist.barrier()


@needs_netns
def test_namespaces_are_removed_when_a_rank_fails() -> None:
    with pytest.raises(WorkerError, match="rank 1"):
        launch(_fail_on_rank_one, 2, timeout_s=20, link=LinkSpec.parse("400mbit"))
    assert _ours() == []


@needs_netns
def test_namespaces_of_a_killed_process_are_removed_by_the_next_user() -> None:
    # A pid above the kernel's maximum is never alive: this stands for a killed bench.
    stale = f"{PREFIX}99999999-dead-r0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedLinks(2, LinkSpec.parse("100mbit")):
            assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    assert _ours() == []


@needs_netns
def test_reshape_changes_the_rate_in_place() -> None:
    with EmulatedLinks(2, LinkSpec.parse("100mbit")) as links:
        links.reshape(LinkSpec.parse("300mbit"))
        shown = subprocess.run(
            ["tc", "-n", links.hub, "qdisc", "show", "dev", "p1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "300Mbit" in shown
    assert _ours() == []


def _namespace_of_rank(rank: int, world: int) -> str:
    return os.readlink("/proc/self/ns/net")


@needs_netns
def test_ranks_spread_over_emulated_hosts_share_their_hosts_namespace() -> None:
    with WorkerGroup(4, timeout_s=60, link=LinkSpec.parse("400mbit"), hosts=2) as group:
        assert len(_ours()) == 3  # the hub and two machines, not one namespace per rank
        spaces = group.run(_namespace_of_rank)
        gathered = group.run(_gather_and_where)
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3]
    assert [g[0] for g in gathered] == [[1.0] * 3 + [2.0] * 3 + [3.0] * 3 + [4.0] * 3] * 4
    assert _ours() == []
    with pytest.raises(WorkerError, match="3 emulated hosts for 4 ranks"):
        WorkerGroup(4, link=LinkSpec.parse("400mbit"), hosts=3)
