"""The dynamic (CPU) path against the oracles: every eager kernel against its
reference in ``runtime.kernels.reference`` (fp32 and bf16 — the eager kernels are plain torch,
so bf16 runs on a CPU), the real-length decode attention against the static paged
attention over reconstructed caches, chunked prefill against whole-prompt causal
attention, and batch sampling. Tolerances per dtype: fp32 1e-4 and bf16 2e-2 of the
output's scale (bf16 rounds inputs and products to 8 bits)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.engine.model_runner import Piece, prefill_chunks
from runtime.engine.sampling import make_generator, sample
from runtime.engine.sequence import SamplingParams
from runtime.kernels import eager, reference
from runtime.kernels.eager import rope_rotation
from runtime.model.eager_attention import (
    LatentFactors,
    cache_context,
    causal_attention,
    decode_dense,
    decode_latent,
)
from runtime.model.key_angles import GROWTH, KeyAngles
from runtime.model.latent_basis import copy_basis
from runtime.model.paged_cache import LayerCache
from runtime.model.rope import inv_freq
from tests.kernel_utils import TOLERANCE

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
TOL = {**TOLERANCE, torch.bfloat16: 2e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 40), st.integers(1, 40))
def test_gemm_touches_only_valid_rows(rows, n_valid, k, n):
    n_valid = min(n_valid, rows)
    a, b = randn(rows, k, seed=1), randn(k, n, seed=2)
    out = torch.full((rows, n), 7.0)
    want = reference.gemm_fixed(a, b, torch.full((rows, n), 7.0), torch.tensor([n_valid]))
    got = eager.gemm_fixed(a, b, out, torch.tensor([n_valid]))
    close(got, want, torch.float32, "gemm")
    assert (got[n_valid:] == 7.0).all()


@given(st.integers(1, 30), st.integers(1, 50), st.integers(1, 50), DTYPES, st.booleans())
def test_matmul_through_a_transposed_weight(m, k, n, dtype, transposed):
    a = randn(m, k, seed=3, dtype=dtype)
    w = randn(k, n, seed=4, dtype=dtype) / math.sqrt(k)
    b = w.t().contiguous().t() if transposed else w
    if k > 1 and n > 1:
        assert eager.stored_transposed(b) == transposed
    close(eager.matmul(a, b), a.float() @ w.float(), dtype, "matmul")


@given(st.integers(1, 9), st.sampled_from([8, 16, 64]), st.sampled_from(["rms", "layer"]), DTYPES)
def test_normalize_matches_reference(rows, width, kind, dtype):
    x, w, b = (
        randn(rows, width, seed=5, dtype=dtype) * 3,
        randn(width, seed=6),
        randn(width, seed=7),
    )
    bias = b if kind == "layer" else None
    want = reference.apply_norm(x, w, bias, norm=kind, eps=1e-5)
    close(eager.normalize(x, w, bias, norm=kind, eps=1e-5), want, dtype, kind)


@given(
    st.integers(1, 10),
    st.integers(0, 10),
    st.integers(1, 4),
    st.sampled_from([4, 8, 16]),
    st.sampled_from(["neox", "gptj"]),
)
def test_rope_matches_reference(rows, n_valid, heads, d, style):
    n_valid = min(n_valid, rows)
    x = randn(rows, heads, d, seed=8)
    pos = torch.randint(0, 100, (rows,), generator=torch.Generator().manual_seed(9))
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    n = torch.tensor([n_valid])
    want = reference.rope_inplace(x.clone(), pos, freqs, n, style=style)
    close(eager.rope_inplace(x.clone(), pos, freqs, n, style=style), want, torch.float32, style)


@given(st.data())
def test_block_copy_matches_reference(data):
    blocks, bs, width = 12, 4, 5
    src = randn(blocks, bs, width, seed=10)
    runs = data.draw(st.lists(st.tuples(st.integers(0, 8), st.integers(1, 3)), max_size=3))
    copy_list, dst_next = [], 0
    for s, n in runs:
        copy_list.append((s, dst_next, n))
        dst_next += n
    live = len(copy_list)
    table = torch.tensor(copy_list + [(0, 0, 0)] * (4 - live), dtype=torch.int32)
    dst_ref, dst = torch.full((10, bs, width), -1.0), torch.full((10, bs, width), -1.0)
    want = reference.kv_block_copy(src, dst_ref, table, torch.tensor([live]))
    assert torch.equal(eager.kv_block_copy(src, dst, table, torch.tensor([live])), want)


def paged_case(seed: int, lengths: list[int], kv: int, group: int, d: int, bs: int):
    """A shuffled pool with one block table per sequence."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lengths]
    pool = sum(per_seq) + 2
    order = torch.randperm(pool, generator=g).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(order[at : at + n])
        at += n
    width = max(per_seq)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lengths), kv * group, d, generator=g)
    k = torch.randn(pool, bs, kv, d, generator=g)
    v = torch.randn(pool, bs, kv, d, generator=g)
    return tables, table_t, q, k, v


@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
)
def test_paged_attention_and_decode_dense_match_reference(lengths, kv, group, d):
    bs = 4
    tables, table_t, q, k, v = paged_case(11, lengths, kv, group, d, bs)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = d**-0.5
    want = reference.paged_decode_attention(
        q, k, v, table_t, lens, torch.empty_like(q), scale=scale
    )
    got = eager.paged_decode_attention(q, k, v, table_t, lens, torch.empty_like(q), scale=scale)
    close(got, want, torch.float32, "paged kernel")
    ctx = cache_context(tables, lengths, bs, None, torch.device("cpu"))
    close(decode_dense(q, LayerCache("dense", k=k, v=v), ctx, scale), want, torch.float32, "dense")


def up_in_copy_basis(r_k: int, kv: int, d: int, style: str, ranks: int | None):
    """(U_k of the last of ``ranks`` ranks with kv heads each, whether it is in the copy
    basis); ranks None: random factors as they are."""
    if ranks is None:
        return randn(r_k, kv * d, seed=14), False
    width = kv * d
    whole = randn(r_k, ranks * width, seed=14)
    groups = tuple((i * width, (i + 1) * width) for i in range(ranks))
    basis = copy_basis(randn(3, r_k, seed=19), whole, groups, d, style)
    # random factors have one where they have a pair and no more columns than keys
    assert (basis is None) == (r_k < 2 or r_k > whole.shape[1])
    return (whole if basis is None else basis[1])[:, -width:], basis is not None


@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=4),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 9),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["neox", "gptj", "none"]),
    st.sampled_from([None, 1, 2]),
    st.booleans(),
)
# every key copied (full rank, bias added in place); a later rank's copied range
@example([5, 9], 1, 2, 8, 3, True, False, "neox", 1, False)
@example([7], 2, 1, 9, 2, True, False, "gptj", 2, False)
@example([7, 30, 1], 2, 3, 9, 2, False, False, "gptj", 2, True)
def test_decode_latent_matches_reconstruct_then_attend(
    lengths, kv, group, r_k, r_v, bias, k_norm, style, copy_ranks, native
):
    """Rebuild K (norm, RoPE at true positions) and V for every cached token, then the
    reference paged attention: the same as keys rebuilt per batch with V absorbed.
    ``copy_ranks``: U_k in the copy basis of that many ranks' heads (this rank: the
    last one's), so that some or all keys are the latent's own columns. ``native``:
    scored by the native kernel where it takes the layer (no bias, no norm, RoPE)."""
    d, bs = 8, 4
    tables, table_t, q, _, _ = paged_case(12, lengths, kv, group, d, bs)
    pool = max(max(t) for t in tables) + 2
    latent = randn(pool, bs, r_k + r_v, seed=13)
    u_k, basis = up_in_copy_basis(r_k, kv, d, style, copy_ranks)
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = LatentFactors(
        r_k=r_k,
        kv_heads=kv,
        head_dim=d,
        u_k=u_k,
        u_v=randn(r_v, kv * d, seed=15),
        bias_k=randn(kv * d, seed=16) if bias else None,
        bias_v=randn(kv * d, seed=17) if bias else None,
        k_norm=randn(d, seed=18) if k_norm else None,
        eps=1e-6,
        rope_style=style,
        inv_freq=None if style == "none" else freqs,
        native=native,
    )
    assert (f.native_scores is not None) == (native and not bias and not k_norm and style != "none")
    if basis:  # pairs taken in turn, the first rank first; none with k_norm
        assert f.copies == (0 if k_norm else 2 * (r_k // 2 // copy_ranks))
    rows = latent.view(-1, r_k + r_v)
    keys = rows[:, :r_k] @ f.u_k + (f.bias_k if bias else 0)
    keys = keys.view(-1, kv, d)
    if k_norm:
        keys = reference.apply_norm(keys, f.k_norm, None, norm="rms", eps=1e-6)
    positions = torch.arange(bs).repeat(pool)  # slot position within its block
    per_slot = torch.zeros(pool * bs, dtype=torch.int32)
    for t in tables:
        for i, block in enumerate(t):
            per_slot[block * bs : (block + 1) * bs] = positions[:bs] + i * bs
    if style != "none":  # "none": no RoPE (OPT's learned positions)
        keys = reference.rope_inplace(
            keys.clone(), per_slot, freqs, torch.tensor([pool * bs]), style=style
        )
    values = (rows[:, r_k:] @ f.u_v + (f.bias_v if bias else 0)).view(-1, kv, d)
    lens = torch.tensor(lengths, dtype=torch.int32)
    want = reference.paged_decode_attention(
        q,
        keys.view(pool, bs, kv, d),
        values.view(pool, bs, kv, d),
        table_t,
        lens,
        torch.empty_like(q),
        scale=d**-0.5,
    )
    rope = None if style == "none" else freqs
    ctx = cache_context(tables, lengths, bs, rope, torch.device("cpu"), style)
    got = decode_latent(q, LayerCache("latent", latent=latent), ctx, f, d**-0.5)
    close(got, want, torch.float32, "latent")


@given(st.integers(1, 20), st.integers(0, 19), st.integers(1, 3), st.integers(1, 3))
def test_causal_attention_of_a_continued_chunk(total, start, kv, group):
    """Queries start.. against keys 0..: the rows of whole-sequence causal attention."""
    start = min(start, total - 1)
    d = 8
    q, k, v = (randn(total, h, d, seed=s) for s, h in ((20, kv * group), (21, kv), (22, kv)))
    whole = causal_attention(q, k, v, 0, d**-0.5)
    part = causal_attention(q[start:], k, v, start, d**-0.5)
    close(part, whole[start:], torch.float32, "chunk")
    rep = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    plain = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), rep[0].transpose(0, 1), rep[1].transpose(0, 1), is_causal=True
    )
    close(whole, plain.transpose(0, 1), torch.float32, "gqa")


@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(1, 17))
def test_prefill_chunks_cover_every_token_once_in_order(lengths, chunk):
    chunks = prefill_chunks(lengths, chunk)
    assert all(0 < sum(p.stop - p.start for p in c) <= chunk for c in chunks)
    pieces = [p for c in chunks for p in c]
    for seq, length in enumerate(lengths):
        mine = [p for p in pieces if p.seq == seq]
        assert mine[0].start == 0 and mine[-1].stop == length
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
    assert prefill_chunks([5], 512) == [[Piece(0, 0, 5)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_tables_of_a_cache_context(style, dtype):
    """The context's tables rotate keys at positions 0..L-1 as the reference does, in
    fp32, the result in the keys' dtype."""
    from dsl.spec import Positions

    freqs = inv_freq(Positions(kind="rope", theta=10000.0), 8)
    ctx = cache_context([[0, 1]], [7], 4, freqs, torch.device("cpu"), style)
    x = randn(7, 2, 8, seed=31).to(dtype)
    want = reference.rope_inplace(x.clone(), torch.arange(7), freqs, torch.tensor([7]), style=style)
    got = eager.rotate(x, ctx.cos[:, None, :], ctx.sin[:, None, :], style)
    assert got.dtype == dtype
    close(got, want, dtype, style)


def test_batch_sampling():
    logits = randn(4, 50, seed=30)
    greedy = SamplingParams()
    assert sample(logits, [greedy] * 4, [None] * 4) == logits.argmax(-1).tolist()
    top1 = SamplingParams(temperature=1.5, top_k=1, seed=3)
    nucleus = SamplingParams(temperature=0.7, top_p=1e-6, seed=4)
    rows = [top1, nucleus, greedy, SamplingParams(temperature=1.0, seed=5)]
    draw = [make_generator(p, i) if p.temperature else None for i, p in enumerate(rows)]
    first = sample(logits, rows, draw)
    assert first[:3] == logits.argmax(-1).tolist()[:3]
    again = [make_generator(p, i) if p.temperature else None for i, p in enumerate(rows)]
    assert sample(logits, rows, again) == first  # seeded: reproducible


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    params = SamplingParams(temperature=1.0, seed=0)
    g = make_generator(params, 0)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(logits, [params], [g])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)
    capped = SamplingParams(temperature=1.0, top_p=0.6, seed=0)
    g = make_generator(capped, 0)
    seen = {sample(logits, [capped], [g])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.6: the second token is needed, the third is not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_proj_and_latent_up_match_reference(dtype):
    x, w = randn(6, 20, seed=40, dtype=dtype), randn(20, 9, seed=41, dtype=dtype) / 5
    nw = randn(20, seed=42, dtype=dtype)
    want = reference.down_proj(x, w, torch.empty(6, 9), nw, None, norm="rms", eps=1e-5)
    got = eager.down_proj(x, w, torch.empty(6, 9, dtype=dtype), nw, None, norm="rms", eps=1e-5)
    close(got, want, dtype, "down_proj")
    segments = (((0, 0, 4), (4, 0, 3)), ((0, 4, 2), (0, 0, 0)))
    us = (randn(6, 5, seed=43, dtype=dtype), randn(3, 7, seed=44, dtype=dtype))
    chunk = randn(6, 7, seed=45, dtype=dtype)
    for j in (0, 1):
        ref_acc = (torch.zeros(6, 5), torch.zeros(6, 7))
        acc = (torch.zeros(6, 5), torch.zeros(6, 7))
        reference.latent_up_chunk(chunk, j, us, ref_acc, segments=segments)
        eager.latent_up_chunk(chunk, j, us, acc, segments=segments)
        for a, b in zip(acc, ref_acc, strict=True):
            close(a, b, dtype, "latent_up")


def test_key_angles_are_the_rotation_at_every_length_as_the_table_grows():
    """The kept table (grown ``GROWTH`` positions at a time) gives each pair's angle at
    positions 0..L-1 exactly as a gather from that step's rotation would, as L grows
    past a growth and comes back down."""
    freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    index = torch.tensor([3, 0, 7, 7, 1])
    angles = KeyAngles(freqs, index)
    for length in (1, 5, GROWTH, GROWTH + 1, 3 * GROWTH - 2, 7):
        want = rope_rotation(torch.arange(length), freqs)[:, index]
        assert torch.equal(angles(length), want), length
    assert angles.table.shape == (3 * GROWTH, 5)


def test_the_real_tables_are_the_rotation_pair_by_pair_as_they_grow():
    """cos and signed sin of each pair at its two columns (x·cos + swap(x)·sin rotates
    the pair by the kept angle), zero past the pairs; made apart from the complex table."""
    freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    index = torch.tensor([3, 0, 7])
    angles, longest = KeyAngles(freqs, index), 0
    for length in (2, GROWTH + 3, 5):
        cos, sin = angles.tables(length, 8)
        longest = max(longest, length)  # grown, never shrunk
        assert cos.shape == sin.shape == (-(-longest // GROWTH) * GROWTH, 8)
        want = rope_rotation(torch.arange(length), freqs)[:, index]
        x = randn(length, 6, seed=30)
        rotated = x * cos[:length, :6] + x.view(length, 3, 2).flip(-1).flatten(1) * sin[:length, :6]
        complex_product = torch.view_as_real(torch.view_as_complex(x.view(length, 3, 2)) * want)
        close(rotated, complex_product.flatten(1), torch.float32, "rotated")
        assert not cos[:, 6:].any() and not sin[:, 6:].any()
    assert angles.table.numel() == 0  # the complex table is never made
