"""The native latent scores and values (``runtime.kernels.latent_scores``) against
torch's form (``eager_attention.torch_latent_scores``: the keys rebuilt by one GEMM,
rotated by a complex product, scored by batched products; probabilities · z_v by a
batched product), each reading its tokens' latents from cache rows in random order.

fp32 only; tolerance 1e-4 of the scores' scale (each score sums r_k products per key
column and KV·D per query, in another order). Over hypothesis shapes: head_dim and KV
heads up to cpu-135m's (64, 3) so that the rebuilt columns span several of the
kernel's register chunks, ranks that copy none, some or all key columns, lengths that
end inside a tile of tokens, one or two threads; and the source built for narrower
vector units than this CPU's (AVX2's 8 lanes, the portable 4), so the code other
machines run is tested here too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import latent_scores, native_build
from runtime.model.eager_attention import LatentFactors, torch_latent_scores
from tests.conftest import assert_x86_vectors, narrower_builds
from tests.test_eager import randn, up_in_copy_basis

TOL = 1e-4


def _factors(
    kv: int,
    d: int,
    r_k: int,
    style: str,
    copy_ranks: int | None,
    native: bool,
    r_v: int = 3,
    bias_v: bool = False,
    v_rows: str = "dense",
) -> LatentFactors:
    u_k, _ = up_in_copy_basis(r_k, kv, d, style, copy_ranks)
    return LatentFactors(
        r_k=r_k,
        kv_heads=kv,
        head_dim=d,
        u_k=u_k,
        u_v=value_up(r_v, kv, d, v_rows),
        bias_k=None,
        bias_v=randn(kv * d, seed=16) if bias_v else None,
        k_norm=None,
        eps=1e-6,
        rope_style=style,
        inv_freq=1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)),
        native=native,
    )


def value_up(r_v: int, kv: int, d: int, rows: str) -> torch.Tensor:
    """U_v [r_v, kv · d]: ``dense``; ``heads``: KV head g's columns zero outside rows
    [g·r_v/kv, (g+1)·r_v/kv) (as in the copy basis, where a head's rows are its own
    latent columns); ``ranges``: zero outside a random range of rows per head, some of
    them empty or shorter than a vector."""
    u = randn(r_v, kv * d, seed=15)
    g = torch.Generator().manual_seed(r_v * 31 + kv)
    for head in range(kv if rows != "dense" else 0):
        if rows == "heads":
            first, end = head * r_v // kv, (head + 1) * r_v // kv
        else:
            first = int(torch.randint(0, r_v + 1, (1,), generator=g))
            end = int(torch.randint(first, r_v + 1, (1,), generator=g))
        u[:first, head * d : (head + 1) * d] = 0
        u[end:, head * d : (head + 1) * d] = 0
    return u


def _case(lengths: list[int], kv: int, group: int, d: int, r_k: int):
    """z [B, L, r_k + 3] (zero past each length), block-diagonal queries, mask bias."""
    batch, longest = len(lengths), max(lengths)
    z = randn(batch, longest, r_k + 3, seed=21)
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    z = z * valid[..., None]
    queries = randn(batch, kv * group, kv * d, seed=22)
    head = torch.arange(kv * d) // d
    queries = queries * (head[None, :] == torch.arange(kv).repeat_interleave(group)[:, None])
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    return z, queries, valid, bias


def paged(z: torch.Tensor, valid: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z [B, L, C] as a cache: rows [slots, C] (z's valid rows in random order among
    rows of noise) and slots [B, L] (row of token j of sequence b; 0 past its length)."""
    g = torch.Generator().manual_seed(seed)
    count = int(valid.sum())
    rows = torch.randn(2 * count + 3, z.shape[-1], generator=g)
    where = torch.randperm(rows.shape[0], generator=g)[:count]
    rows[where] = z[valid]
    slots = torch.zeros(valid.shape, dtype=torch.long)
    slots[valid] = where
    return rows, slots


def _scores_match(lengths, kv, group, d, r_k, style, copy_ranks) -> None:
    native = _factors(kv, d, r_k, style, copy_ranks, True)
    plain = _factors(kv, d, r_k, style, copy_ranks, False)
    assert native.native_scores is not None, "the native kernel did not build or take it"
    z, queries, valid, bias = _case(lengths, kv, group, d, r_k)
    rows, slots = paged(z, valid, seed=sum(lengths))
    got = native.native_scores(rows, slots, valid.sum(-1), queries)
    want = torch_latent_scores(plain, z[..., :r_k].clone(), queries, bias)
    assert torch.equal(torch.isinf(got), ~valid[:, None, :].expand_as(got))
    finite = valid[:, None, :].expand_as(got)
    scale = want[finite].abs().max().item() + 1e-6
    err = (got[finite] - want[finite]).abs().max().item()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


@settings(deadline=None)  # the profile's examples: 25 in CI, 300 thorough
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([8, 16, 64]),
    r_k=st.integers(1, 130),
    style=st.sampled_from(["neox", "gptj"]),
    copy_ranks=st.sampled_from([None, 1, 2]),
    threads=st.sampled_from([1, 2]),
)
# cpu-135m's layer at 40% (116 of 192 key columns copied, 76 rebuilt over 5 vectors)
@example([7, 23, 1, 16], 3, 3, 64, 116, "neox", 1, 2)
def test_the_native_scores_equal_torch_s(lengths, kv, group, d, r_k, style, copy_ranks, threads):
    r_k = min(r_k, kv * d * (copy_ranks or 1))  # no more latent columns than keys
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _scores_match(lengths, kv, group, d, r_k, style, copy_ranks)
    finally:
        torch.set_num_threads(before)


def _values_match(lib, lengths: list[int], heads: int, r_k: int, r_v: int) -> None:
    batch, longest = len(lengths), max(lengths)
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    z = randn(batch, longest, r_k + r_v, seed=23)
    scores = randn(batch, heads, longest, seed=24).masked_fill(~valid[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    rows, slots = paged(z, valid, seed=r_v)
    got = lib.values(probs, rows, slots, valid.sum(-1), r_k)
    want = torch.bmm(probs.double(), (z * valid[..., None])[..., r_k:].double()).float()
    scale = want.abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    assert err <= TOL * scale, f"max error {err:.3g} > {TOL} x {scale:.3g}"


@settings(deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    heads=st.integers(1, 10),
    r_k=st.integers(0, 20),
    r_v=st.integers(1, 200),
    threads=st.sampled_from([1, 2]),
)
@example([256, 3, 255], 9, 116, 116, 2)  # cpu-135m at 40%: the last vector overlaps
def test_the_native_values_equal_a_plain_product(lengths, heads, r_k, r_v, threads):
    """probabilities · z_v over r_v below, at and past the vector width (one column at a
    time, whole vectors, a last vector overlapping the one before) and spans of columns."""
    lib = latent_scores.latent_scores_library()
    assert lib is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _values_match(lib, lengths, heads, r_k, r_v)
    finally:
        torch.set_num_threads(before)


@narrower_builds
def test_narrower_builds_compute_the_same_scores(tmp_path: Path, monkeypatch, flags, width):
    assert_x86_vectors()
    lib = latent_scores.build_library("cc", tmp_path / "lib.so", (*native_build.FLAGS, *flags))
    assert lib.width == width
    monkeypatch.setattr(latent_scores, "latent_scores_library", lambda: lib)
    monkeypatch.setattr("runtime.model.native_key_scores.latent_scores_library", lambda: lib)
    for lengths, kv, d, r_k, copy_ranks in [
        ([5, 2], 1, 8, 5, None),
        ([9, 1, 4], 2, 16, 20, 1),
        ([13], 3, 64, 116, 1),
        ([3, 11], 2, 64, 128, 1),  # every key column copied
    ]:
        _scores_match(lengths, kv, 2, d, r_k, "neox", copy_ranks)
    for lengths, heads, r_v in [([5, 2], 3, 3), ([9, 1], 5, 8), ([13], 9, 116), ([3, 11], 2, 200)]:
        _values_match(lib, lengths, heads, 4, r_v)


def test_layers_the_kernel_does_not_take_keep_torch_s_form():
    f = _factors(2, 8, 6, "neox", 1, True)
    assert f.native_scores is not None
    kwargs = {"r_k": 6, "kv_heads": 2, "head_dim": 8, "eps": 1e-6, "rope_style": "neox"}
    kwargs |= {"u_v": randn(3, 16, seed=1), "bias_v": None}
    freqs = f.inv_freq
    for u_k, bias_k, k_norm, inv_freq in [
        (f.u_k, randn(16, seed=2), None, freqs),  # a bias on k
        (f.u_k, None, randn(8, seed=3), freqs),  # Qwen3's norm on k
        (f.u_k, None, None, None),  # no RoPE
        (f.u_k.double(), None, None, freqs),  # not fp32
    ]:
        other = LatentFactors(u_k=u_k, bias_k=bias_k, k_norm=k_norm, inv_freq=inv_freq, **kwargs)
        assert other.native_scores is None


def test_the_kernel_rejects_operands_it_would_misread():
    lib = latent_scores.latent_scores_library()
    assert lib is not None
    w = lib.width
    rows, slots, lengths = torch.randn(10, 10), torch.arange(10).view(2, 5), torch.tensor([5, 3])
    u, cos, queries = torch.zeros(8, w), torch.zeros(5, w), torch.zeros(2, 3, w)
    args = (lengths, 8, (0, 2), u, cos, cos, queries)
    assert lib.scores(rows, slots, *args).shape == (2, 3, 5)
    with pytest.raises(ValueError, match="fp32 operands"):
        lib.scores(rows.double(), slots, *args)
    with pytest.raises(ValueError, match="even copies"):
        lib.scores(rows, slots, lengths, 8, (0, 3), u, cos, cos, queries)
    with pytest.raises(ValueError, match="tables"):
        lib.scores(rows, slots, lengths, 8, (0, 2), u, cos[:4], cos[:4], queries)
    with pytest.raises(ValueError, match="row-contiguous"):
        lib.scores(rows.t(), slots, *args)
    with pytest.raises(ValueError, match="row-contiguous"):
        lib.scores(rows.flatten(), slots, *args)
    with pytest.raises(ValueError, match="slots within the cache's rows"):
        lib.scores(rows, slots + 1, torch.tensor([5, 5]), *args[1:])  # a token at row 10 of 10
    probs = torch.full((2, 3, 5), 0.2)
    assert lib.values(probs, rows, slots, lengths, 8).shape == (2, 3, 2)
    assert lib.values(probs, rows, slots + 2, lengths.clamp(max=3), 8).shape == (2, 3, 2)
    with pytest.raises(ValueError, match="slots within the cache's rows"):
        lib.values(probs, rows, slots - 1, lengths, 8)
    with pytest.raises(ValueError, match="some z_v columns"):
        lib.values(probs, rows, slots, lengths, 10)
    with pytest.raises(ValueError, match=r"probs \[B, H, L\]"):
        lib.values(probs[:, :, :4], rows, slots, lengths, 8)


def test_turned_off_there_is_no_native_form(monkeypatch):
    try:
        monkeypatch.setenv("DEINFER_NO_NATIVE", "1")
        latent_scores.latent_scores_library.cache_clear()
        assert latent_scores.latent_scores_library() is None
        assert _factors(2, 8, 6, "neox", 1, True).native_scores is None
    finally:
        monkeypatch.undo()
        latent_scores.latent_scores_library.cache_clear()
    assert latent_scores.latent_scores_library() is not None


def test_value_rows_are_each_heads_span_of_rows_not_zero():
    """(first, count) per KV head of U_v [kv_heads, r_v, d]: from the first row that is
    not all zero to the last, zero rows inside kept; (0, 0) for an all-zero head."""
    u_v = torch.zeros(3, 10, 4)
    u_v[0, 2:5] = 1.0
    u_v[0, 7, 3] = -2.0  # a zero row (5, 6) inside the span
    u_v[1] = 1.0
    got = latent_scores.value_rows(u_v)
    assert got.dtype == torch.int64
    assert got.tolist() == [[2, 6], [0, 10], [0, 0]]
