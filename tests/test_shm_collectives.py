"""The shared-memory collectives of same-host CPU ranks against gloo's: all-reduce gives
the same sums (fp32 to rounding, bf16 to its precision), bit-identical on every rank,
all-gather exactly gloo's result, over shapes, dtypes and world sizes (3 ranks on 2 cores
exercise the yielding wait), and nothing is left in /dev/shm; the launcher's ranks pinned
round-robin over the cores."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.dist.launcher import launch
from tests.conftest import TP_EXAMPLES
from tests.tp_workers import (
    core_affinity,
    mixed_layout_all_reduce,
    shm_all_gather,
    shm_all_reduce,
)

SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
CASES = st.lists(
    st.tuples(SHAPES, st.sampled_from([torch.float32, torch.bfloat16])), min_size=1, max_size=6
)


@settings(max_examples=TP_EXAMPLES)
@given(st.integers(2, 3), CASES, st.integers(0, 2**16))
def test_shm_all_reduce_matches_gloo(world, cases, seed):
    results = launch(shm_all_reduce, world, cases, seed, timeout_s=120)
    for (shape, dtype), *per_rank in zip(cases, *(r[0] for r in results), strict=True):
        diffs = [d for d, _ in per_rank]
        tol = 1e-5 if dtype == torch.float32 else 0.1
        assert max(diffs) <= tol * world, (shape, dtype, diffs)
        first = per_rank[0][1]
        assert all(torch.equal(first, got) for _, got in per_rank), "ranks disagree"
        assert first.shape == shape
    assert all(gone for _, gone in results), "segment left in /dev/shm"


def test_all_reduce_sums_logical_elements_whatever_the_layout():
    """A transposed view on one rank and contiguous tensors on the others (a rank whose
    shard is empty multiplies by a plain GEMM) sum element by element, on both paths."""
    results = launch(mixed_layout_all_reduce, 3, (19, 36), timeout_s=120)
    assert results == [[True, True]] * 3


GATHERS = st.lists(
    st.tuples(
        st.integers(1, 20), st.integers(1, 700), st.sampled_from([torch.float32, torch.bfloat16])
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=TP_EXAMPLES)
@given(st.integers(2, 3), GATHERS, st.integers(0, 2**16))
def test_shm_all_gather_matches_gloo(world, cases, seed):
    """Exactly gloo's gather (a copy, no arithmetic), in rank order, for both gathers
    the layers use; 20 x 700 fp32 exceeds the 64 KB slots and falls back to gloo."""
    results = launch(shm_all_gather, world, cases, seed, timeout_s=120)
    assert results == [[True] * len(cases)] * world


def test_ranks_are_pinned_round_robin_over_the_cores():
    """Rank r on core r modulo the cores: one each where they suffice, two ranks to a
    core (never migrating) where they do not (one rank more than the cores here)."""
    cores = sorted(os.sched_getaffinity(0))
    world = len(cores) + 1
    got = launch(core_affinity, world, timeout_s=120)
    assert got == [[cores[r % len(cores)]] for r in range(world)]
