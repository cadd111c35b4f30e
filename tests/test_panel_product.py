"""The native decode product (``runtime.kernels.panel``) against the plain product.

fp32 only; tolerance 1e-4 of the output's scale, as for the torch forms (it sums each
output in k order, one FMA per term). Over hypothesis shapes: any row count (the kernel
takes them in passes of at most its register rows, shared evenly), K and N odd and below
one panel, and one or two threads (OpenMP shares the panels out). The source is also
built for narrower vector units than this CPU's (AVX2's 8 lanes and 12 register rows;
the portable 4-lane form), so the code other machines run is tested here too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kernels import panel
from runtime.kernels.cpu_gemm import Form, _fastest
from tests.conftest import assert_x86_vectors, narrower_builds

TOL = 1e-4


def _library() -> panel.PanelLibrary:
    lib = panel.panel_library()
    assert lib is not None, "the native kernel did not build: the CPU path needs a C compiler"
    return lib


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.abs().max().item() + 1e-6
    return (got.double() - want).abs().max().item() <= TOL * scale


def _product_matches(lib: panel.PanelLibrary, rows: int, k: int, n: int) -> None:
    a = torch.randn(rows, k)
    b = torch.randn(n, k).t()  # [K, N] stored [N, K], as the runner keeps its matrices
    got = lib.product(a, lib.pack(b), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert _close(got, a.double() @ b.double())


@settings(deadline=None)
@given(
    rows=st.integers(1, 70),
    k=st.integers(1, 300),
    n=st.integers(1, 100),
    threads=st.sampled_from([1, 2]),
)
def test_the_native_product_equals_the_plain_one(rows, k, n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _product_matches(_library(), rows, k, n)
    finally:
        torch.set_num_threads(before)


@settings(deadline=None, max_examples=20)
@given(rows=st.integers(1, 20), k=st.integers(1, 40), n=st.integers(1, 40), skip=st.integers(0, 9))
def test_a_column_slice_of_a_wider_tensor_is_read_in_place(rows, k, n, skip):
    """A latent's column slice (rows wider apart than K) gives the product of its copy."""
    lib = _library()
    wide = torch.randn(rows, skip + k + 3)
    a = wide[:, skip : skip + k]
    b = torch.randn(n, k).t()
    assert torch.equal(lib.product(a, lib.pack(b), n), lib.product(a.contiguous(), lib.pack(b), n))


def test_panels_hold_the_columns_in_order_zero_past_the_last():
    lib = _library()
    w = torch.randn(lib.width + 3, 5)  # [N, K]: one whole panel and three columns
    panels = lib.pack(w.t())
    assert panels.shape == (2, 5, lib.width)
    assert torch.equal(panels[0], w[: lib.width].t())
    assert torch.equal(panels[1, :, :3], w[lib.width :].t())
    assert not panels[1, :, 3:].any()


def test_the_kernel_rejects_operands_it_would_misread():
    lib = _library()
    b = torch.randn(20, 8).t()
    panels = lib.pack(b)
    with pytest.raises(ValueError, match="fp32"):
        lib.product(torch.randn(2, 8).double(), panels, 20)
    with pytest.raises(ValueError, match="panels of shape"):
        lib.product(torch.randn(2, 9), panels, 20)


@narrower_builds
def test_narrower_builds_compute_the_same_product(tmp_path: Path, flags, width):
    assert_x86_vectors()
    lib = panel.build_library("cc", tmp_path / "lib.so", (*panel.FLAGS, *flags))
    assert lib.width == width
    for rows, k, n in [(1, 7, 3), (13, 33, 2 * width + 1), (16, 64, 40), (40, 5, 9)]:
        _product_matches(lib, rows, k, n)


def test_a_broken_build_leaves_nothing_behind(tmp_path: Path):
    target = tmp_path / "lib.so"
    with pytest.raises(subprocess.CalledProcessError):
        panel.build_library("cc", target, ("-this-flag-does-not-exist",))
    assert list(tmp_path.iterdir()) == []


def test_without_a_compiler_or_when_turned_off_there_is_no_native_form(monkeypatch):
    try:
        for env, value in (("CC", "no-such-compiler"), ("DEINFER_NO_NATIVE", "1")):
            with monkeypatch.context() as m:
                m.setenv(env, value)
                panel.panel_library.cache_clear()
                assert panel.panel_library() is None
    finally:
        panel.panel_library.cache_clear()
    assert panel.panel_library() is not None


def test_a_shape_keeps_one_reordered_copy():
    """Where "packed" wins one bucket and "panel" the others, the panel copy is kept
    and that bucket takes its best form among the rest (a tie in buckets: least time)."""
    mm, packed, native = Form("mm"), Form("packed"), Form("panel")
    per_rows = {
        1: {mm: 1.0, packed: 3.0, native: 2.0},
        16: {mm: 5.0, packed: 4.0, native: 2.0},
        64: {mm: 6.0, packed: 3.0, native: 4.0},
    }
    assert _fastest(per_rows) == {1: mm, 16: native, 64: native}
    per_rows[64][mm] = 3.5
    assert _fastest(per_rows) == {1: mm, 16: native, 64: mm}
    tied = {1: {packed: 1.0, native: 2.0}, 16: {packed: 3.0, native: 1.5}}
    assert _fastest(tied) == {1: native, 16: native}  # 4.0 vs 3.5 in all
