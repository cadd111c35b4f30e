"""The overlapped up-projection in a real 2- and 3-rank gloo group equals
gather-then-GEMM, consumes the local chunk first, and counts as one all-gather."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from codegen.generate import generate, write_atomically
from dsl import parse_spec
from runtime.dist.failures import CallFailed, first_cause
from runtime.dist.launcher import WorkerError, WorkerGroup
from tests.conftest import SPECS
from tests.tp_workers import run_overlapped_up


@pytest.mark.parametrize("tp", [2, 3])
def test_overlapped_up_projection_equals_gather_then_gemm(tmp_path, tp):
    raw = yaml.safe_load((SPECS / "tiny-llama.yaml").read_text())
    raw["model"].update(num_heads=6, num_kv_heads=6, head_dim=12)  # heads that 2 and 3 divide
    raw["parallel"]["tp"] = tp
    text = yaml.safe_dump(raw)
    folder = tmp_path / "gen"
    write_atomically(generate(parse_spec(text, "tiny")).files, folder)
    m = 5
    with WorkerGroup(tp, timeout_s=120) as workers:
        for group, shape_id in (("attn", "s0"), ("attn", "s1"), ("mlp", "s0"), ("mlp", "s1")):
            results = workers.run(run_overlapped_up, str(folder), group, shape_id, m, 7)
            for rank, (diff, order, gathered_ok, elements) in enumerate(results):
                assert diff < 1e-4, (group, shape_id, rank, diff)
                assert order[0] == rank and sorted(order) == list(range(tp))
                assert gathered_ok
                assert elements == m * chunk_width(folder, group, shape_id) * tp


def chunk_width(folder, group, shape_id) -> int:
    manifest = json.loads((folder / "manifest.json").read_text())
    ranks = manifest["layer_shapes"][shape_id]["ranks"]
    members = ("q", "k", "v") if group == "attn" else ("gate", "up")
    total = sum(ranks[n] for n in members if ranks[n] is not None)
    return -(-total // manifest["tp"])


def _boom(rank, world):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def _hang(rank, world):
    if rank == 1:
        import time

        time.sleep(60)
    return rank


def _boom_before_a_collective(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one leaves its peer in an all-reduce")
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_failing_rank_is_named_and_the_group_goes_on():
    """Every rank answered (one with its error): the group is intact for the next call."""
    with WorkerGroup(2, timeout_s=60) as group:
        with pytest.raises(CallFailed, match="rank 1 failed: ValueError: rank one fails"):
            group.run(_boom)
        assert group.run(_rank) == [0, 1]


def test_a_failure_that_strands_a_peer_in_a_collective_ends_the_group():
    start = time.monotonic()
    with WorkerGroup(2, timeout_s=60) as group:
        with pytest.raises(WorkerError, match=r"did not answer within 5 s \(stuck in a collective"):
            group.run(_boom_before_a_collective)
        assert time.monotonic() - start < 30
        # the ranks are gone: a later call says so at once, not with a peer's symptom
        with pytest.raises(WorkerError, match=r"closed .* start a new one"):
            group.run(_rank)


def test_the_rank_named_is_the_cause_not_a_peer_that_lost_it():
    lost = "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    cause = "Traceback ...\nOSError: [Errno 39] Directory not empty"
    assert first_cause({0: ("error", lost), 3: ("error", cause), 1: ("error", lost)}) == 3
    assert first_cause({1: ("error", lost), 0: ("error", lost)}) == 1  # the first to report


def _rank(rank, world):
    return rank


def test_hanging_rank_is_named():
    with (
        WorkerGroup(2, timeout_s=60) as group,
        pytest.raises(WorkerError, match="rank 1 did not answer"),
    ):
        group.run(_hang, timeout_s=3)
