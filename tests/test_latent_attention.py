"""The native latent attention (``eager_attention.decode_latent_native``: the new latents
written and the decode attention in one call) against the cache write and torch's form
(``decode_latent`` with the torch scores: keys rebuilt by one GEMM, rotated, scored by
batched products, softmax, · z_v, times U_v per KV head), on paged caches whose blocks
lie in random order among blocks of noise.

fp32 only; tolerance 1e-4 of the output's scale (the scores sum in another order, and
the softmax is the kernel's). Over hypothesis shapes: up to cpu-135m's head_dim and KV
heads, query groups of 1-3, ranks that copy none, some or all key columns, r_v below
and past the vector width, U_v dense or zero outside a range of rows per KV head (whole
heads as in the copy basis, random ranges, empty ones), a bias on v or none, sequences
that end inside a block and inside a tile of tokens, one or two threads; and the source
built for narrower vector units than this CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import eager, latent_scores, native_build
from runtime.kernels.decode_block import Projection, decode_block_library
from runtime.kernels.latent_operands import LatentStep
from runtime.kernels.latent_scores import LatentAttention
from runtime.model.eager_attention import (
    cache_context,
    decode_latent,
    decode_latent_native,
    latent_step,
)
from runtime.model.paged_cache import LayerCache
from tests.conftest import assert_x86_vectors, narrower_builds
from tests.test_decode_block import _panels
from tests.test_latent_scores import _factors

TOL = 1e-4
BLOCK = 4


def _paged(lengths: list[int], width: int, g: torch.Generator):
    """(the context of sequences of ``lengths`` in blocks of a pool in random order, the
    pool [blocks, BLOCK, width], each sequence's last slot: its new token's)."""
    tables, used = [], 0
    blocks = sum(-(-n // BLOCK) for n in lengths) * 2 + 1
    order = torch.randperm(blocks, generator=g).tolist()
    for n in lengths:
        count = -(-n // BLOCK)
        tables.append(order[used : used + count])
        used += count
    ctx = cache_context(tables, lengths, BLOCK, None, torch.device("cpu"))
    pool = torch.randn(blocks, BLOCK, width, generator=g)
    return ctx, pool, ctx.slots[torch.arange(len(lengths)), torch.tensor(lengths) - 1]


def _attention_matches(
    lengths, kv, group, d, r_k, r_v, style, copy_ranks, bias, v_rows="dense"
) -> None:
    native = _factors(kv, d, r_k, style, copy_ranks, True, r_v, bias, v_rows)
    plain = _factors(kv, d, r_k, style, copy_ranks, False, r_v, bias, v_rows)
    assert native.native_scores is not None, "the native kernel did not build or take it"
    g = torch.Generator().manual_seed(sum(lengths) + r_v)
    ctx, pool, new_slots = _paged(lengths, r_k + r_v, g)
    ours, theirs = LayerCache("latent", latent=pool.clone()), LayerCache("latent", latent=pool)
    # the new latents as the layer hands them: columns of a wider gathered latent
    latent = torch.randn(len(lengths), r_k + r_v + 5, generator=g)[:, 2 : 2 + r_k + r_v]
    q = torch.randn(len(lengths), kv * group, d, generator=g)
    got = decode_latent_native(q, latent, latent_step(new_slots, ctx), ours, native, 0.125)
    assert got is not None
    theirs.write(new_slots, None, None, latent)
    want = decode_latent(q, theirs, ctx, plain, 0.125)
    assert torch.equal(ours.latent, theirs.latent), "the new latents not at their slots"
    scale = want.abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


@settings(deadline=None)  # the profile's examples: 25 in CI, 300 thorough
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([8, 12, 16, 64]),  # 12: past whole vectors
    r_k=st.integers(2, 130),
    r_v=st.integers(1, 70),
    style=st.sampled_from(["neox", "gptj"]),
    copy_ranks=st.sampled_from([None, 1, 2]),
    bias=st.booleans(),
    v_rows=st.sampled_from(["dense", "heads", "ranges"]),
    threads=st.sampled_from([1, 2]),
)
# cpu-135m's layer at 40% (116 of 192 key columns copied, 76 rebuilt; r_v 116) and at
# full rank (every key and value column copied: each KV head mixes its own 64 of z_v)
@example([7, 23, 1, 16], 3, 3, 64, 116, 116, "neox", 1, False, "dense", 2)
@example([7, 23, 1, 16], 3, 3, 64, 192, 192, "neox", 1, False, "heads", 2)
def test_the_native_attention_equals_the_write_and_torch_s_form(
    lengths, kv, group, d, r_k, r_v, style, copy_ranks, bias, v_rows, threads
):
    r_k = min(r_k, kv * d * (copy_ranks or 1))  # no more latent columns than keys
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _attention_matches(lengths, kv, group, d, r_k, r_v, style, copy_ranks, bias, v_rows)
    finally:
        torch.set_num_threads(before)


@narrower_builds
def test_narrower_builds_attend_the_same(tmp_path: Path, monkeypatch, flags, width):
    assert_x86_vectors()
    lib = latent_scores.build_library("cc", tmp_path / "lib.so", (*native_build.FLAGS, *flags))
    assert lib.width == width
    monkeypatch.setattr("runtime.model.native_key_scores.latent_scores_library", lambda: lib)
    for lengths, kv, d, r_k, r_v, copy_ranks in [
        ([5, 2], 1, 8, 5, 3, None),
        ([9, 1, 4], 2, 16, 20, 8, 1),
        ([13], 3, 64, 116, 116, 1),
        ([3, 11], 2, 64, 128, 9, 1),  # every key column copied
        ([6, 2], 1, 12, 10, 5, 1),  # head_dim past whole vectors
    ]:
        for group in (2, 3):  # whole and partial register tiles of a KV head's heads
            for v_rows in ("dense", "ranges"):
                args = (lengths, kv, group, d, r_k, r_v, "neox", copy_ranks, True, v_rows)
                _attention_matches(*args)


def test_the_native_attention_refuses_what_it_would_misread():
    f = _factors(2, 8, 6, "neox", 1, True)
    ctx = cache_context([[0, 1], [2]], [5, 3], BLOCK, None, torch.device("cpu"))
    cache = LayerCache("latent", latent=torch.randn(4, BLOCK, 9))
    q, latent, new_slots = torch.randn(2, 4, 8), torch.randn(2, 9), torch.tensor([4, 10])
    step = latent_step(new_slots, ctx)
    assert decode_latent_native(q, latent, step, cache, f, 1.0).shape == (2, 4, 8)
    assert decode_latent_native(q.double(), latent, step, cache, f, 1.0) is None
    assert decode_latent_native(q, None, step, cache, f, 1.0) is None
    with pytest.raises(ValueError, match="slots within the cache's rows"):
        decode_latent_native(q, latent, latent_step(torch.tensor([4, 16]), ctx), cache, f, 1.0)
    with pytest.raises(ValueError, match="new latents"):
        decode_latent_native(q, latent[:, :8], step, cache, f, 1.0)
    with pytest.raises(ValueError, match="whole KV head groups"):
        decode_latent_native(q[:, :3], latent, step, cache, f, 1.0)
    with pytest.raises(ValueError, match="contiguous int64 slots"):
        latent_step(new_slots.int(), ctx)  # the step's tokens are checked once, when made


def _latent_half(lengths, kv, group, d, r_k, r_v, kv_first, seed):
    """A latent-cache layer's projections (q's matrix beside a latent whose k|v columns
    start at ``kv_first``), its factors, cache and step, and q's RoPE tables."""
    g = torch.Generator().manual_seed(seed)
    f = _factors(kv, d, r_k, "neox", 1, True, r_v)
    ctx, pool, new_slots = _paged(lengths, r_k + r_v, g)
    hidden, heads, columns = 24, kv * group, kv_first + r_k + r_v + 3
    q_w = torch.randn(hidden, heads * d, generator=g) / hidden**0.5
    kv_w = torch.randn(hidden, columns, generator=g) / hidden**0.5
    projections = (Projection(_panels(q_w), heads * d), Projection(_panels(kv_w), columns))
    positions = torch.tensor(lengths) - 1
    cos, sin = eager.rope_tables(positions, f.inv_freq, "neox")
    rope = (cos[:, None, :], sin[:, None, :], d, d // 2)
    x = torch.randn(len(lengths), hidden, generator=g)
    norm = (torch.rand(hidden, generator=g) + 0.5, 1e-6)
    return f, pool, latent_step(new_slots, ctx), projections, rope, x, norm


@settings(deadline=None)
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=3),
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([8, 16, 64]),
    r_k=st.integers(2, 40),
    r_v=st.integers(1, 30),
    kv_first=st.integers(0, 5),
    seed=st.integers(0, 10_000),
)
def test_the_decode_blocks_latent_half_is_its_two_calls_in_one(
    lengths, kv, group, d, r_k, r_v, kv_first, seed
):
    """``DecodeBlockLibrary.latent_attention`` (q and the latent, then the latent attention,
    in one native call) against ``q_and_latent`` then ``decode_latent_native``: the same
    residual, cache rows and heads' output, bit for bit (the same kernels in turn)."""
    r_k = min(r_k, kv * d)
    f, pool, step, (q_proj, kv_proj), rope, x, norm = _latent_half(
        lengths, kv, group, d, r_k, r_v, kv_first, seed
    )
    lib, m, scores = decode_block_library(), len(lengths), f.native_scores
    x_two, cache_two = x.clone(), LayerCache("latent", latent=pool.clone())
    q, latent = lib.q_and_latent(x_two, [], norm, q_proj, kv_proj, rope)
    new = latent[:, kv_first : kv_first + r_k + r_v]
    want = decode_latent_native(q.view(m, -1, d), new, step, cache_two, f, 0.125)
    cache = LayerCache("latent", latent=pool.clone())
    tables = scores.angles.tables(step.slots.shape[1], scores.layer.wpad)
    operands = (scores.layer, step, cache.latent_rows, tables, 0.125)
    attention = LatentAttention(scores.library, *operands)
    got = lib.latent_attention(x, [], norm, (q_proj, kv_proj, kv_first), rope, attention)
    assert torch.equal(x, x_two), "the residual differs"
    assert torch.equal(cache.latent, cache_two.latent), "the new latents differ"
    assert torch.equal(got, want.view(m, -1)), "the heads' output differs"


def test_the_decode_blocks_latent_half_refuses_what_it_would_misread():
    f, pool, step, (q_proj, kv_proj), rope, x, norm = _latent_half([5, 3], 2, 2, 8, 6, 3, 2, 0)
    lib, scores, rows = decode_block_library(), f.native_scores, pool.view(-1, 9)
    tables = scores.angles.tables(step.slots.shape[1], scores.layer.wpad)
    attention = LatentAttention(scores.library, scores.layer, step, rows, tables, 1.0)
    past = (q_proj, kv_proj, 6)  # 6 + r_k + r_v past the latent's 14 columns
    with pytest.raises(ValueError, match=r"k\|v columns within the latent"):
        lib.latent_attention(x, [], norm, past, rope, attention)
    projections = (q_proj, kv_proj, 0)
    with pytest.raises(ValueError, match="cache rows of r_k"):
        narrow = attention._replace(rows=rows[:, :8])
        lib.latent_attention(x, [], norm, projections, rope, narrow)
    far = LatentStep(torch.tensor([2, rows.shape[0]]), step.slots, step.lengths)
    with pytest.raises(ValueError, match="slots within the cache's rows"):
        lib.latent_attention(x, [], norm, projections, rope, attention._replace(step=far))
