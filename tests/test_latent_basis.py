"""k's and v's factors in their copy bases (``runtime.model.latent_basis``): the same
product; U_k's chosen columns the identity, whole RoPE pairs, each rank's copies one
contiguous range of the latent that decode finds (``eager_attention.latent_layout``);
U_v's whole KV heads the identity, taken in turn from the ranks, so that their query
heads mix only their own head_dim latent columns (``latent_scores.value_rows``). A model
served with a latent cache from them gives transformers' tokens (``test_engine``)."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from dsl import build_plan, load_spec
from dsl.sharding import COLS
from runtime.kernels.eager import rope_pair_order
from runtime.kernels.latent_scores import value_rows
from runtime.model.eager_attention import latent_layout
from runtime.model.latent_basis import (
    MAX_ENTRY,
    CopyBasisSource,
    basis_columns,
    copy_basis,
    in_basis,
    rank_pairs,
    value_columns,
)
from runtime.model.shard import DictSource


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _factors(rank, ranks, heads, d, seed):
    """rank (at most the columns), the rank groups' column ranges, random D [11, rank] and
    U [rank, ranks · heads · d]"""
    out = ranks * heads * d
    rank = min(rank, out)
    groups = tuple((i * heads * d, (i + 1) * heads * d) for i in range(ranks))
    return rank, groups, randn(11, rank, seed=seed), randn(rank, out, seed=seed + 1)


def _assert_same_product(new_down, new_up, down, up):
    # fp32 factors: within 1e-5 of the product's scale (the worst over the whole strategy
    # space of the k basis: 2.9e-6, rank 28 of 48 columns, entries of S⁻¹·U_k up to 41)
    product = down.double() @ up.double()
    scale = product.abs().max().item()
    assert torch.allclose(new_down.double() @ new_up.double(), product, atol=1e-5 * scale)


@given(
    st.integers(2, 40),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
    st.sampled_from(["neox", "gptj", "none"]),
)
@example(28, 4, 3, 4, "neox")  # the largest rounding (CI's hypothesis found it)
@example(8, 3, 1, 4, "neox")  # refused: an entry of S⁻¹·U_k over MAX_ENTRY
def test_copy_basis_keeps_the_product_and_copies_whole_pairs(rank, ranks, heads, d, style):
    rank, groups, down, up = _factors(rank, ranks, heads, d, seed=1)
    basis = copy_basis(down, up, groups, d, style)
    if basis is None:  # refused only for the documented reason: S⁻¹·U_k's entries too
        columns = basis_columns(up, groups, d, style)  # large (e.g. rank 8 of 12 columns
        assert columns is not None  # over 3 ranks: 139 against MAX_ENTRY 64)
        assert torch.linalg.solve(up.double()[:, columns], up.double()).abs().max() > MAX_ENTRY
        return
    new_down, new_up = basis
    _assert_same_product(new_down, new_up, down, up)
    assert new_up.abs().max() <= MAX_ENTRY
    pairs = [p for group in rank_pairs(groups, d, style) for p in group]
    unit = ((new_up != 0).sum(0) == 1) & (new_up.amax(0) == 1)
    assert int(unit.sum()) == rank  # S's columns became the identity
    # every rank finds its copied pairs as one range of the latent, the ranges in rank
    # order and back to back, the pairs shared out in turn (first ranks first)
    order = rope_pair_order(d, style)
    start, counts = 0, []
    for lo, hi in groups:
        first, copies, layout = latent_layout(new_up[:, lo:hi], heads, order)
        assert sorted(layout.tolist()) == list(range(hi - lo))
        assert copies == 0 or first == start
        start += copies
        counts.append(copies // 2)
    assert start == 2 * (rank // 2)
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    copied = {c for a, b in pairs if unit[a] and unit[b] for c in (a, b)}
    assert len(copied) == 2 * (rank // 2)


def test_full_rank_latent_is_the_pre_rope_key():
    """r = out: U_k becomes a permutation, so the latent is x·W_k itself, its columns
    in pair order head by head (neox, head_dim 4: 0 2 1 3)."""
    down, up = randn(16, 8, seed=3), randn(8, 8, seed=4)
    new_down, new_up = copy_basis(down, up, ((0, 8),), 4, "neox")
    layout = [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(new_up, torch.eye(8)[:, torch.tensor(layout).argsort()])
    assert torch.allclose(new_down, (down @ up)[:, layout], atol=1e-5)


def test_no_basis_where_it_cannot_help():
    down = randn(6, 5, seed=5)
    assert copy_basis(down, randn(5, 4, seed=6), ((0, 4),), 4, "neox") is None  # r > out
    low = randn(5, 2, seed=7) @ randn(2, 8, seed=8)  # rank 2 < r = 5
    assert copy_basis(down, low, ((0, 8),), 4, "neox") is None


def test_copy_basis_source_changes_only_k_and_v(repo):
    """The source hands out k's and v's factors in their copy bases, each rank's heads a
    group, sliced as asked; every other tensor as stored."""
    spec = load_spec(repo / "specs" / "tiny-llama.yaml")  # tp 2, 2 KV heads of 16, r_k 13
    lp = build_plan(spec, modes=("deinfer",)).modes["deinfer"].layer_plans[0]
    full = {"k.v": randn(64, 13, seed=9), "k.u": randn(13, 32, seed=10)}
    full |= {"v.v": randn(64, 17, seed=12), "v.u": randn(17, 32, seed=13)}
    full["q.u"] = randn(27, 64, seed=11)
    source = CopyBasisSource(DictSource(full), lp, spec.model.head_dim, "neox")
    d, u = source.factor("k.v", "", 0, 0), source.factor("k.u", "", 0, 0)
    assert torch.allclose(d @ u, full["k.v"] @ full["k.u"], atol=1e-4)
    assert torch.equal(source.factor("k.u", COLS, 16, 32), u[:, 16:])
    assert torch.equal(source.factor("k.v", COLS, 0, 5), d[:, :5])
    assert torch.equal(source.factor("q.u", "", 0, 0), full["q.u"])
    order = rope_pair_order(16, "neox")
    assert [latent_layout(u[:, lo:hi], 1, order)[:2] for lo, hi in ((0, 16), (16, 32))] == [
        (0, 6),
        (6, 6),
    ]
    # v: rank 0's head whole (the identity at latent columns 0..15), one more column
    dv, uv = source.factor("v.v", "", 0, 0), source.factor("v.u", "", 0, 0)
    assert torch.allclose(dv @ uv, full["v.v"] @ full["v.u"], atol=1e-4)
    assert torch.equal(uv[:, :16], torch.eye(17)[:, :16])
    assert value_rows(uv.view(17, 2, 16).transpose(0, 1)).tolist() == [[0, 16], [0, 17]]
    narrow = {"v.v": randn(64, 11, seed=12), "v.u": randn(11, 32, seed=13)}  # r_v < head_dim
    source = CopyBasisSource(DictSource(full | narrow), lp, spec.model.head_dim, "neox")
    assert torch.equal(source.factor("v.u", "", 0, 0), narrow["v.u"])


@given(
    st.integers(1, 40),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
)
@example(116, 1, 3, 64)  # cpu-135m at 40 %: one head whole, the others mix all 116
@example(192, 1, 3, 64)  # full rank: every head its own 64 columns
def test_value_basis_keeps_the_product_and_makes_whole_heads_their_own(rank, ranks, heads, d):
    rank, groups, down, up = _factors(rank, ranks, heads, d, seed=3)
    columns = value_columns(up, groups, d)
    if rank < d:
        assert columns is None  # no head would be whole: the factors stay as stored
        return
    assert columns is not None
    basis = in_basis(down, up, columns)
    if basis is None:  # refused only for the documented reason
        assert torch.linalg.solve(up.double()[:, columns], up.double()).abs().max() > MAX_ENTRY
        return
    new_down, new_up = basis
    _assert_same_product(new_down, new_up, down, up)
    # whole heads in turn from the ranks (rank 0's first head, rank 1's first, ...)
    turns = [g * heads + h for h in range(heads) for g in range(ranks)]
    whole = turns[: rank // d]
    rows = value_rows(new_up.view(rank, ranks * heads, d).transpose(0, 1)).tolist()
    for i, head in enumerate(whole):
        assert rows[head] == [i * d, d]
        assert torch.equal(new_up[i * d : (i + 1) * d, head * d : (head + 1) * d], torch.eye(d))
