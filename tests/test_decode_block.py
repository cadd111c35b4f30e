"""The native decode block (``runtime/kernels/native/decode_block.c``) against plain torch:
each half-block's residual update, cache writes and output over hypothesis-drawn shapes
(rows past the kernel's 16-row pass, head sizes off the vector width, GQA groups, RoPE
styles, all-reduce summands, each projection dense or low-rank with odd ranks, each half
whole or cut where the ranks gather a low-rank group's latent), fp32
only (the kernel's one dtype): the residual bit-exact (same sums in the same order), the
outputs within 1e-4 (the products' and the softmax's sums run in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kernels import eager
from runtime.kernels.decode_block import Projection, decode_block_library
from runtime.kernels.panel import panel_library

pytestmark = pytest.mark.skipif(
    decode_block_library() is None or panel_library() is None,
    reason="no C compiler here: the decode block did not build",
)
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _panels(w: torch.Tensor) -> torch.Tensor:
    """w [in, out] as the kernel's panels."""
    return panel_library().pack(w.t().contiguous().t())


class _Reference:
    """A projection as the reference multiplies it: x·W, or each member's x·D_i·U_i
    side by side (its latent first, as the kernel computes it)."""

    def __init__(self, dense: torch.Tensor | None, factors: list | None = None) -> None:
        self.dense, self.factors = dense, factors or []

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return x @ self.dense
        return torch.cat([(x @ d) @ u for d, u in self.factors], dim=1)


def _projection(
    gen: torch.Generator, k: int, widths: list[int], ranks: list[int] | None
) -> tuple[Projection, _Reference]:
    """A projection from k inputs to the columns ``widths`` (side by side): dense
    (``ranks`` None), or each member low-rank with its down factors concatenated."""
    if ranks is None:
        w = torch.randn(k, sum(widths), generator=gen) / k**0.5  # outputs of order 1, as in a model
        return Projection(_panels(w), w.shape[1]), _Reference(w)
    downs = [torch.randn(k, r, generator=gen) / k**0.5 for r in ranks]
    ups = [torch.randn(r, n, generator=gen) / r**0.5 for r, n in zip(ranks, widths, strict=True)]
    cat = torch.cat(downs, dim=1)
    members = tuple((_panels(u), r, n) for u, r, n in zip(ups, ranks, widths, strict=True))
    reference = _Reference(None, list(zip(downs, ups, strict=True)))
    return Projection(_panels(cat), cat.shape[1], members), reference


def _cut(
    gen: torch.Generator, k: int, widths: list[int], ranks: list[int]
) -> tuple[Projection, Projection, _Reference]:
    """A low-rank projection cut where the ranks all-gather its latent: the down factors
    side by side as one dense projection, and the up factors alone (input: the latent)."""
    whole, reference = _projection(gen, k, widths, ranks)
    cat = torch.cat([d for d, _ in reference.factors], dim=1)
    down = Projection(_panels(cat), cat.shape[1])
    return down, Projection(None, 0, whole.ups), reference


def _cache_slots(gen: torch.Generator, m: int) -> tuple[torch.Tensor, ...]:
    """A decode step's cache operands for m sequences of 1-29 tokens, each token its own
    slot of the cache (spread at random, a few spare): lengths [m], slots [m, longest]
    (0 past a length), each row's new slot (its last token's), the cache's slot count."""
    lengths = torch.randint(1, 30, (m,), generator=gen)
    cache_slots = int(lengths.sum()) + 3
    order = torch.randperm(cache_slots, generator=gen)
    slots, used = torch.zeros(m, int(lengths.max()), dtype=torch.long), 0
    for r, n in enumerate(lengths.tolist()):
        slots[r, :n] = order[used : used + n]
        used += n
    return lengths, slots, slots[torch.arange(m), lengths - 1].clone(), cache_slots


# a projection's members' ranks: None (dense), or odd, 1, past the vector width
RANKS = st.one_of(st.none(), st.lists(st.integers(1, 21), min_size=3, max_size=3))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _residual(x: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return x.clone()
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return x + total


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 20),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half_dim=st.sampled_from([1, 2, 3, 4, 8, 9, 32]),
    hidden=st.integers(1, 40),
    parts=st.integers(0, 3),
    style=st.sampled_from(["neox", "gptj"]),
    qkv_ranks=RANKS,
    o_ranks=RANKS,
    cut=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_attention_half_equals_torch(
    m, kv_heads, group, half_dim, hidden, parts, style, qkv_ranks, o_ranks, cut, seed
):
    """``cut`` > 0 with low-rank q|k|v: the half as across ranks, in two calls (norm and
    down factors; then from the latent, ``cut`` - 1 padding columns after it, to o's
    down factor of width ``hidden`` + ``cut``)."""
    gen = torch.Generator().manual_seed(seed)
    cut = cut if qkv_ranks is not None else 0
    d, heads = 2 * half_dim, kv_heads * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x, summands = rand(m, hidden), [rand(m, hidden) for _ in range(parts)]
    norm_w = rand(hidden)
    qkv_widths = [heads * d, kv_heads * d, kv_heads * d]
    if cut:
        qkv_down, qkv_proj, w_qkv = _cut(gen, hidden, qkv_widths, qkv_ranks)
        o_proj, w_o = _projection(gen, heads * d, [hidden + cut], None)
    else:
        qkv_proj, w_qkv = _projection(gen, hidden, qkv_widths, qkv_ranks)
        o_proj, w_o = _projection(gen, heads * d, [hidden], o_ranks and o_ranks[:1])
    lengths, slots, new_slots, cache_slots = _cache_slots(gen, m)
    longest = slots.shape[1]
    k_rows, v_rows = rand(cache_slots, kv_heads, d), rand(cache_slots, kv_heads, d)
    positions = lengths - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = eager.rope_tables(positions, inv_freq, style)
    scale, eps = d**-0.5, 1e-5

    # torch: the layer's ops one by one
    x_want = _residual(x, summands)
    qkv = _rms(x_want, norm_w, eps) @ w_qkv
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    rot = (cos[:, None], sin[:, None], style)
    q = eager.torch_rotate(q.reshape(m, heads, d), *rot)
    k = eager.torch_rotate(k.reshape(m, kv_heads, d), *rot)
    k_want, v_want = k_rows.clone(), v_rows.clone()
    k_want[new_slots], v_want[new_slots] = k, v.reshape(m, kv_heads, d)
    valid = torch.arange(longest)[None] < lengths[:, None]
    attended = eager.grouped_attention(q, k_want[slots], v_want[slots], valid, scale)
    out_want = attended.reshape(m, heads * d) @ w_o

    lib, source, norm = decode_block_library(), x, (norm_w, eps)
    if cut:
        latent = lib.norm_project(x, summands, norm, qkv_down)
        source, summands, norm = torch.cat([latent, rand(m, cut - 1)], dim=1), [], None
    out = lib.attention(
        source, summands, norm, qkv_proj, (heads, kv_heads, d),
        (cos.contiguous(), sin.contiguous(), half_dim if style == "neox" else 0),
        (k_rows, v_rows, new_slots, slots, lengths.long()), scale, o_proj,
    )  # fmt: skip
    assert torch.equal(x, x_want)
    assert torch.allclose(k_rows, k_want, **TOL) and torch.allclose(v_rows, v_want, **TOL)
    assert torch.allclose(out, out_want, **TOL)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 20),
    hidden=st.integers(1, 40),
    inter=st.integers(1, 50),
    parts=st.integers(0, 3),
    gate_up_ranks=RANKS,
    down_ranks=RANKS,
    cut=st.integers(0, 3),
    seed=st.integers(0, 10_000),
    after=st.one_of(st.none(), st.tuples(st.integers(1, 30), st.none() | st.integers(1, 9))),
)
def test_mlp_half_equals_torch(
    m, hidden, inter, parts, gate_up_ranks, down_ranks, cut, seed, after
):
    """``cut`` as in the attention half's test; the first summand a transposed view (as a
    product computed as (W·aᵀ)ᵀ comes). ``after`` (latent width, its projection's rank or
    None): a latent times its projection added to x in the same call (a latent-cache
    layer's heads' output times W_o; cut, in the first call: across ranks the previous row
    group's reduced latent times its up factor)."""
    gen = torch.Generator().manual_seed(seed)
    cut = cut if gate_up_ranks is not None else 0

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x, summands = rand(m, hidden), [rand(m, hidden) for _ in range(parts)]
    summands[:1] = [s.t().contiguous().t() for s in summands[:1]]
    norm_w = rand(hidden)
    if cut:
        gate_up_down, gate_up_proj, w_gate_up = _cut(gen, hidden, [inter, inter], gate_up_ranks[:2])
        down_proj, w_down = _projection(gen, inter, [hidden + cut], None)
    else:
        gate_up_proj, w_gate_up = _projection(
            gen, hidden, [inter, inter], gate_up_ranks and gate_up_ranks[:2]
        )
        down_proj, w_down = _projection(gen, inter, [hidden], down_ranks and down_ranks[:1])
    heads_o = None
    if after is not None:
        o_proj, w_o = _projection(gen, after[0], [hidden], after[1] and [after[1]])
        heads_o = (rand(m, after[0]), o_proj)
    x_want = _residual(x, summands + ([heads_o[0] @ w_o] if heads_o else []))
    gate, up = (_rms(x_want, norm_w, 1e-6) @ w_gate_up).split(inter, dim=1)
    out_want = (F.silu(gate) * up) @ w_down
    lib, source, norm = decode_block_library(), x, (norm_w, 1e-6)
    if cut:
        latent = lib.norm_project(x, summands, norm, gate_up_down, heads_o)
        source, summands, norm = torch.cat([latent, rand(m, cut - 1)], dim=1), [], None
        heads_o, x_after = None, heads_o
    else:
        x_after = heads_o
    out = lib.mlp(source, summands, norm, gate_up_proj, inter, down_proj, heads_o)
    assert torch.equal(x, x_want) if x_after is None else torch.allclose(x, x_want, **TOL)
    assert torch.allclose(out, out_want, **TOL)


def test_operands_it_would_misread_are_refused():
    lib, gen = decode_block_library(), torch.Generator().manual_seed(0)
    x = torch.randn(2, 8)
    gate_up, _ = _projection(gen, 8, [2, 2], None)
    down, _ = _projection(gen, 2, [8], None)
    with pytest.raises(ValueError, match="summand"):
        lib.mlp(x, [torch.randn(3, 8)], (torch.ones(8), 1e-6), gate_up, 2, down)
    o, _ = _projection(gen, 5, [8], None)
    with pytest.raises(ValueError, match=r"a latent \(2, 4\) to add to x"):  # o's input is 5 wide
        lib.mlp(x, [], (torch.ones(8), 1e-6), gate_up, 2, down, (torch.randn(2, 4), o))
    with pytest.raises(ValueError, match="to add to x"):  # no norm: x is a latent
        lib.mlp(x, [], None, gate_up, 2, down, (torch.randn(2, 5), o))
    with pytest.raises(ValueError, match="to add to x"):  # no norm: the summand would be lost
        lib.norm_project(torch.randn(2, 2), [], None, down, (torch.randn(2, 5), o))
    with pytest.raises(ValueError, match="contiguous fp32"):
        lib.mlp(x.t().contiguous().t(), [], (torch.ones(8), 1e-6), gate_up, 2, down)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 20),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half_dim=st.sampled_from([1, 3, 8, 32]),
    extra=st.integers(0, 5),
    seed=st.integers(0, 10_000),
)
def test_cached_attention_writes_and_attends_as_torch(m, kv_heads, group, half_dim, extra, seed):
    """The attention alone (layers that make their own projections): k and v rows at any
    stride (v a column slice of a wider product) written, then attended over the cache."""
    gen = torch.Generator().manual_seed(seed)
    d, heads = 2 * half_dim, kv_heads * group
    q = torch.randn(m, heads, d, generator=gen)
    k = torch.randn(m, kv_heads, d, generator=gen)
    wide = torch.randn(m, kv_heads * d + extra, generator=gen)
    v = wide[:, extra:].reshape(m, kv_heads, d)  # rows kv_heads * d + extra apart
    lengths, slots, new_slots, cache_slots = _cache_slots(gen, m)
    longest = slots.shape[1]
    k_rows = torch.randn(cache_slots, kv_heads, d, generator=gen)
    v_rows = torch.randn(cache_slots, kv_heads, d, generator=gen)
    k_want, v_want = k_rows.clone(), v_rows.clone()
    k_want[new_slots], v_want[new_slots] = k, v
    valid = torch.arange(longest)[None] < lengths[:, None]
    want = eager.grouped_attention(q, k_want[slots], v_want[slots], valid, d**-0.5)
    operands = (k_rows, v_rows, new_slots, slots, lengths.long())
    got = decode_block_library().cached_attention(q, k, v, operands, d**-0.5)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    assert torch.allclose(got, want, **TOL)
    # operands it does not take: the caller keeps to torch's ops
    assert decode_block_library().cached_attention(q.double(), k, v, operands, 1.0) is None


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 20),
    hidden=st.integers(1, 40),
    q_width=st.integers(1, 40),
    q_rank=st.one_of(st.none(), st.integers(1, 21)),
    kv_ranks=st.lists(st.integers(1, 21), min_size=2, max_size=2),
    parts=st.integers(0, 3),
    seed=st.integers(0, 10_000),
    rope=st.sampled_from([None, (2, "neox"), (4, "gptj"), (6, "neox"), (10, "gptj")]),
)
def test_a_latent_cache_layers_projections_equal_torch(
    m, hidden, q_width, q_rank, kv_ranks, parts, seed, rope
):
    """A latent-cache layer's q and k|v latent from one norm (``q_and_latent``): q's
    matrix beside the k and v down factors, or (q_rank not None) q's latent first among
    the group's down factors and its up factor from it; ``rope`` (head_dim, style): q's
    heads then rotated in the same call, against ``eager.torch_rotate``."""
    gen = torch.Generator().manual_seed(seed)
    tables = None
    if rope is not None:
        d, style = rope
        q_width = -(-q_width // d) * d  # whole heads
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
        cos, sin = eager.rope_tables(torch.randint(0, 500, (m,), generator=gen), inv_freq, style)
        tables = (cos[:, None, :], sin[:, None, :], d, d // 2 if style == "neox" else 0)
    x, norm_w = torch.randn(m, hidden, generator=gen), torch.rand(hidden, generator=gen) + 0.5
    summands = [torch.randn(m, hidden, generator=gen) for _ in range(parts)]
    x_want = _residual(x, summands)
    normed = _rms(x_want, norm_w, 1e-6)
    lib, norm = decode_block_library(), (norm_w, 1e-6)
    if q_rank is None:
        q_proj, q_ref = _projection(gen, hidden, [q_width], None)
        kv = torch.randn(hidden, sum(kv_ranks), generator=gen) / hidden**0.5
        kv_proj = Projection(_panels(kv), kv.shape[1])
        q, latent = lib.q_and_latent(x, summands, norm, q_proj, kv_proj, tables)
        q_want, latent_want = normed @ q_ref, normed @ kv
    else:
        cat = torch.randn(hidden, q_rank + sum(kv_ranks), generator=gen) / hidden**0.5
        u_q = torch.randn(q_rank, q_width, generator=gen) / q_rank**0.5
        proj = Projection(_panels(cat), cat.shape[1], ((_panels(u_q), q_rank, q_width),))
        q, latent = lib.q_and_latent(x, summands, norm, None, proj, tables)
        latent_want = normed @ cat
        q_want = latent_want[:, :q_rank] @ u_q
    if rope is not None:
        heads = q_want.view(m, -1, d)
        q_want = eager.torch_rotate(heads, cos[:, None, :], sin[:, None, :], style).view(m, -1)
    assert torch.equal(x, x_want)
    assert torch.allclose(q, q_want, **TOL) and torch.allclose(latent, latent_want, **TOL)
