"""Block manager and scheduler invariants, and the latent-decode compaction plan."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from codegen.families import kv_copy, paged_attention
from runtime.engine.block_manager import BlockManager
from runtime.engine.kv_cache import plan_compaction
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence import SamplingParams, Sequence, Status
from runtime.kernels import reference
from tests.kernel_utils import import_kernel


def _check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    owners = Counter(b for s in live for b in s.block_table)
    assert len(set(bm.free)) == len(bm.free), "a block is free twice"
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == owners[block], f"block {block} refcount"
        assert (block in bm.free) == (owners[block] == 0), f"block {block} leaked or owned+free"
    for s in live:
        assert len(s.block_table) >= bm.blocks_needed(len(s)) - 1


@given(
    st.integers(2, 12),
    st.sampled_from([1, 2, 4]),
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "fork", "finish"]), st.integers(1, 9), st.integers(1, 6)
        ),
        max_size=40,
    ),
)
def test_block_manager_and_scheduler_invariants(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_seq_len=40, max_prefill_tokens=16), bm)
    forks: list[Sequence] = []
    next_id = 0
    for op, a, b in ops:
        if op == "add":
            seq = Sequence(next_id, list(range(a)), SamplingParams(max_tokens=b))
            next_id += 1
            sched.add(seq)
            if seq.status is Status.FINISHED:
                assert seq.finish_reason.startswith("error")
        elif op == "step" and sched.has_work():
            batch, _prefill = sched.schedule()
            for s in batch:
                s.output.append(0)
                if len(s.output) >= s.params.max_tokens:
                    sched.finish(s, "length")
        elif op == "fork" and sched.running:
            child = Sequence(10_000 + next_id, [], SamplingParams())
            next_id += 1
            bm.share(sched.running[0], child)
            forks.append(child)
        elif op == "finish" and forks:
            bm.free_sequence(forks.pop())
        _check_invariants(bm, sched.running + forks)
    for s in list(sched.running):
        sched.finish(s, "length")
    for f in forks:
        bm.free_sequence(f)
    assert sorted(bm.free) == list(range(num_blocks)), "blocks leaked"


def test_scheduler_preempts_instead_of_crashing_and_rejects_too_long():
    bm = BlockManager(4, 2)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_seq_len=8, max_prefill_tokens=64), bm)
    a, b = (Sequence(i, [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(2))
    too_long = Sequence(2, [1] * 6, SamplingParams(max_tokens=4))
    for s in (a, b, too_long):
        sched.add(s)
    assert too_long.status is Status.FINISHED and "exceeds max_seq_len 8" in too_long.finish_reason
    batch, prefill = sched.schedule()
    assert prefill and batch == [a, b] and len(bm.free) == 0
    for s in batch:
        s.output.append(0)
    batch, prefill = sched.schedule()  # 4 tokens each fit in 2 blocks: no new block needed
    for s in batch:
        s.output.append(0)
    batch, prefill = sched.schedule()  # now both need a third block: b is preempted
    assert not prefill and batch == [a] and b.status is Status.WAITING and b.num_preemptions == 1
    assert b.block_table == [] and sched.waiting[0] is b


# --- compaction: copy by the plan, attend with the remapped table ------------------------

CASES = {
    "single block": ([[5]], [3]),
    "fully contiguous": ([[2, 3, 4, 5]], [16]),
    "fully scattered": ([[7, 1, 4], [0, 9]], [10, 5]),
    "shared blocks": ([[3, 4, 6], [3, 4, 8]], [12, 11]),
    "partial last blocks": ([[1, 2], [6]], [5, 1]),
}


def _attend_both(tables, lens, backend, heads=4, kv_heads=2, d=8, bs=4, width=12):
    g = torch.Generator().manual_seed(0)
    num_blocks, max_blocks, rows = 10, 5, len(tables) + 1  # one padded row
    latent = torch.randn(num_blocks, bs, width, generator=g)
    u = torch.randn(width, kv_heads * d, generator=g)
    q = torch.randn(rows, heads, d, generator=g)
    table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t)
    seq_lens = torch.tensor([*lens, 0], dtype=torch.int32)
    # Original: K reconstructed for the whole pool, attention on the paged table.
    k_pool = (latent.view(-1, width) @ u).view(num_blocks, bs, kv_heads, d)
    want = reference.paged_decode_attention(
        q, k_pool, k_pool, table, seq_lens, torch.empty_like(q), scale=d**-0.5
    )
    plan = plan_compaction(tables, lens, bs, max_blocks, 16, rows)
    compact = torch.full((16, bs, width), float("nan"))
    copy = import_kernel(kv_copy.copy_kernel_file([width], bs)).WIDTHS[width]
    attn = import_kernel(paged_attention.kernel_file(heads, kv_heads, d, bs))
    if backend == "triton":
        copy.kv_block_copy(latent, compact, plan.copy_list, plan.num_runs)
    else:
        copy.torch_reference(latent, compact, plan.copy_list, plan.num_runs)
    n = int(plan.n_rows)
    k_rows = torch.zeros(16 * bs, kv_heads * d)
    k_rows[:n] = compact.view(-1, width)[:n] @ u
    k_c = k_rows.view(16, bs, kv_heads, d)
    run = attn.paged_decode_attention if backend == "triton" else attn.torch_reference
    got = run(q, k_c, k_c, plan.remap, seq_lens, torch.empty_like(q))
    return got, want, plan


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compaction_then_remapped_attention_equals_paged_attention(case, backend):
    tables, lens = CASES[case]
    got, want, plan = _attend_both(tables, lens, backend)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if case == "shared blocks":
        assert int(plan.n_rows) == 4 * 4  # blocks 3 and 4 copied once: 3, 4, 6, 8
    if case == "fully contiguous":
        assert int(plan.num_runs) == 1


@given(
    st.lists(
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True), min_size=1, max_size=3
    ),
    st.data(),
)
def test_compaction_random_tables(tables, data):
    lens = [data.draw(st.integers(4 * (len(t) - 1) + 1, 4 * len(t))) for t in tables]
    got, want, plan = _attend_both(tables, lens, "torch")
    assert torch.allclose(got, want, atol=1e-5)
    # positions of compact rows are the true positions of their tokens
    for b, t in enumerate(tables):
        for i in range(len(t)):
            c = int(plan.remap[b, i])
            assert plan.positions[c * 4 : c * 4 + 4].tolist() == list(range(4 * i, 4 * i + 4))
