"""The native row ops (``runtime.kernels.row_ops``: RMSNorm, RoPE, the residual add fused
with the next norm) against torch's forms, which are also what runs where the library
did not build: ``reference.apply_norm``, ``eager.torch_rotate``, and a plain sum.

fp32 only. Tolerances: the norm 1e-5 relative (its mean of squares is summed in another
order), RoPE 1e-6 (the same two products per element, fused differently); the residual
add exact (summed in the all-reduce's order, so every rank's bits are the same as the
unfused ``x + all_reduce(y)``). Over hypothesis shapes (widths that end inside a vector,
strided rows, one to three summands) and the source built for narrower vector units than
this CPU's (AVX2's 8 lanes, the portable 4), so the code other machines run is tested.
And the kernels' exp (``vexp``: their softmaxes and SiLU) against float64's, within 2 ulp
over the range where float32's exp is normal, 0 below it."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kernels import eager, native_build, row_ops
from runtime.kernels.reference import apply_norm
from tests.conftest import assert_x86_vectors, narrower_builds
from tests.test_eager import randn

NORM_TOL, ROPE_TOL = 1e-5, 1e-6


def _library() -> row_ops.RowOpsLibrary:
    lib = row_ops.row_ops_library()
    assert lib is not None, "the native row ops did not build here"
    return lib


def _norm_matches(lib, rows: int, dim: int, scaled: bool, strided: bool) -> None:
    wide = randn(rows, dim + 3, seed=1) * 3
    x = wide[:, :dim] if strided else wide[:, :dim].contiguous()
    weight = randn(dim, seed=2) if scaled else None
    want = apply_norm(x, weight, None, norm="rms", eps=1e-6)
    got = lib.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=NORM_TOL, atol=NORM_TOL)


def _rope_matches(lib, tokens: int, heads: int, dim: int, style: str) -> None:
    qkv = randn(tokens, heads + 2, dim, seed=3)
    x = qkv[:, 1 : heads + 1]  # a view of the fused product's columns, as in a layer
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = eager.rope_tables(torch.arange(tokens) * 7, inv_freq, style)
    cos, sin = cos[:, None], sin[:, None]
    want = eager.torch_rotate(x, cos, sin, style)
    torch.testing.assert_close(lib.rotate(x, cos, sin, style), want, rtol=ROPE_TOL, atol=ROPE_TOL)


def _residual_matches(lib, rows: int, dim: int, parts: int) -> None:
    x = randn(rows, dim, seed=4)
    summands = [randn(rows, dim, seed=5 + j) for j in range(parts)]
    total = summands[0] if parts == 1 else torch.add(summands[0], summands[1])
    for part in summands[2:]:
        total = total + part
    want = x + total
    weight = randn(dim, seed=9)
    got_x = x.clone()
    normed = lib.add_rms_norm(got_x, summands, weight, 1e-6)
    assert torch.equal(got_x, want)
    torch.testing.assert_close(
        normed, apply_norm(want, weight, None, norm="rms", eps=1e-6), rtol=NORM_TOL, atol=NORM_TOL
    )
    only_added = x.clone()
    assert lib.add_rms_norm(only_added, summands, None, 0.0, normalize=False) is only_added
    assert torch.equal(only_added, want)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 20),
    dim=st.integers(1, 300),
    scaled=st.booleans(),
    strided=st.booleans(),
    parts=st.integers(1, 3),
)
def test_the_native_norm_and_residual_add_equal_torch_s(rows, dim, scaled, strided, parts):
    lib = _library()
    _norm_matches(lib, rows, dim, scaled, strided)
    _residual_matches(lib, rows, dim, parts)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 9),
    heads=st.integers(1, 5),
    half=st.integers(1, 40),
    style=st.sampled_from(["neox", "gptj"]),
)
def test_the_native_rotation_equals_torch_s(tokens, heads, half, style):
    _rope_matches(_library(), tokens, heads, 2 * half, style)


def _exp_matches(lib: row_ops.RowOpsLibrary) -> None:
    """Within 2 ulp from -87.3 (exp's normal range) to 88.37 (2^127 · e^(ln2/2)); 0 below
    (float32 has only denormals there); exp(-inf) = 0, exp(nan) = nan. Lengths that end
    inside a vector."""
    x = torch.cat([torch.linspace(-87.3, 88.37, 100_003), torch.randn(1001) * 10])
    got, want = lib.exp(x), torch.exp(x.double())
    ulp = (want.float().nextafter(torch.tensor(float("inf"))) - want.float()).double()
    worst = ((got.double() - want).abs() / ulp).max().item()
    assert worst <= 2.0, f"exp off by {worst:.2f} ulp"
    tails = lib.exp(torch.tensor([-88.0, -100.0, -1e30, float("-inf"), float("nan")]))
    assert tails[:4].tolist() == [0.0] * 4 and tails[4].isnan()


def test_the_kernels_exp_is_within_two_ulp():
    _exp_matches(_library())


@narrower_builds
def test_narrower_builds_compute_the_same_rows(tmp_path: Path, flags, width):
    assert_x86_vectors()
    lib = row_ops.build_library("cc", tmp_path / "lib.so", (*native_build.FLAGS, *flags))
    for rows, dim in [(3, width - 1), (5, width), (2, 2 * width + 3), (16, 2048)]:
        _norm_matches(lib, rows, dim, True, True)
        _residual_matches(lib, rows, dim, 2)
    for half in (width // 2, width, width + 3):
        _rope_matches(lib, 3, 2, 2 * half, "neox")
        _rope_matches(lib, 3, 2, 2 * half, "gptj")
    _exp_matches(lib)


def test_operands_the_kernels_do_not_take_get_none():
    lib = _library()
    x = randn(4, 8, seed=1)
    assert lib.rms_norm(x.double(), None, 1e-6) is None
    assert lib.rms_norm(x.t(), None, 1e-6) is None  # columns not unit-stride
    assert lib.rms_norm(x, randn(7, seed=2), 1e-6) is None  # weight of another width
    assert lib.add_rms_norm(x, [randn(4, 7, seed=3)], None, 1e-6) is None
    assert lib.add_rms_norm(x, [], None, 1e-6) is None
    cos = sin = torch.ones(4, 1, 8)
    assert lib.rotate(randn(4, 2, 8, seed=4), cos, sin, "other") is None
    assert lib.rotate(randn(4, 2, 7, seed=4), cos[..., :7], sin[..., :7], "neox") is None


def test_the_eager_forms_fall_back_to_torch_without_the_library(monkeypatch):
    x, parts, weight = randn(3, 10, seed=1), [randn(3, 10, seed=2), randn(3, 10, seed=3)], None
    native_x = x.clone()
    native = eager.add_and_normalize(native_x, parts, weight, None, norm="rms", eps=1e-6)
    monkeypatch.setattr(eager, "row_ops_library", lambda: None)
    torch_x = x.clone()
    fallback = eager.add_and_normalize(torch_x, parts, weight, None, norm="rms", eps=1e-6)
    assert torch.equal(native_x, torch_x)
    torch.testing.assert_close(native, fallback, rtol=NORM_TOL, atol=NORM_TOL)
    layer_x = x.clone()
    normed = eager.add_and_normalize(layer_x, parts[:1], None, None, norm="layer", eps=1e-6)
    torch.testing.assert_close(normed, apply_norm(x + parts[0], None, None, norm="layer", eps=1e-6))


def test_turned_off_there_is_no_native_form(monkeypatch):
    try:
        monkeypatch.setenv("DEINFER_NO_NATIVE", "1")
        row_ops.row_ops_library.cache_clear()
        assert row_ops.row_ops_library() is None
    finally:
        monkeypatch.undo()
        row_ops.row_ops_library.cache_clear()
    assert row_ops.row_ops_library() is not None
