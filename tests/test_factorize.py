"""The data-aware factorisations of one projection against direct solves, and the
rank allocation. Tolerances: factors are returned in fp32 from fp64 work, so errors
agree with the fp64 optimum to 1e-4 relative."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from compress.allocate import allocate_ranks, break_even_rank, uniform_budget
from compress.factorize import InputStats, factorize, spectrum, whitening_from_gram

REL = 1e-4


@st.composite
def problems(draw, deficient: bool = False):
    n_in = draw(st.integers(2, 24))
    n_out = draw(st.integers(2, 24))
    rank = draw(st.integers(1, min(n_in, n_out)))
    tokens = draw(st.integers(1, n_in - 1)) if deficient else draw(st.integers(n_in + 1, 64))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # channels of very different scale, as in real activations
    scale = torch.exp(torch.randn(n_in, generator=g, dtype=torch.float64))
    x = torch.randn(tokens, n_in, generator=g, dtype=torch.float64) * scale
    w = torch.randn(n_in, n_out, generator=g, dtype=torch.float64)
    return x, w, rank


def _stats(x: torch.Tensor) -> InputStats:
    stats = InputStats(x.shape[1])
    for chunk in x.split(7):  # streamed in pieces, as the hooks do
        stats.add(chunk)
    return stats


def _output_error(x, w, d, u) -> float:
    return float(torch.linalg.norm(x @ (w - d.double() @ u.double())))


@given(problems())
def test_svd_llm_factors_are_the_optimal_rank_r_fit_of_the_outputs(problem):
    x, w, rank = problem
    d, u = factorize(w, rank, "svd-llm", _stats(x))
    assert d.shape == (w.shape[0], rank) and u.shape == (rank, w.shape[1])
    # Direct solve by another route: X = QR, so ‖X·E‖ = ‖R·E‖ and the best rank-r
    # product is the truncated SVD of R·W (Eckart–Young); its error is the tail.
    r_factor = torch.linalg.qr(x, mode="r").R
    tail = torch.linalg.svdvals(r_factor @ w)[rank:]
    optimum = float(tail.square().sum().sqrt())
    ours = _output_error(x, w, d, u)
    assert abs(ours - optimum) <= REL * max(1.0, float(torch.linalg.norm(x @ w)))
    plain_d, plain_u = factorize(w, rank, "svd")
    assert ours <= _output_error(x, w, plain_d, plain_u) * (1 + REL) + REL


@given(problems(deficient=True))
def test_a_semi_definite_gram_matrix_is_shifted_and_still_beats_plain_svd(problem):
    x, w, rank = problem
    stats = _stats(x)
    shift = stats.whitening().shift
    assert shift > 0  # fewer tokens than channels: XᵀX is singular
    d, u = factorize(w, rank, "svd-llm", stats)
    plain_d, plain_u = factorize(w, rank, "svd")
    # The shifted problem minimises ‖X·E‖² + shift·‖E‖²; plain SVD is one candidate.
    plain_e = w - plain_d.double() @ plain_u.double()
    bound = _output_error(x, w, plain_d, plain_u) ** 2 + shift * float(plain_e.square().sum())
    assert _output_error(x, w, d, u) ** 2 <= bound * (1 + 1e-3) + 1e-6


@given(problems(), st.sampled_from([0.25, 0.5, 1.0]))
def test_asvd_factors_are_optimal_in_the_activation_scaled_norm(problem, alpha):
    x, w, rank = problem
    stats = _stats(x)
    d, u = factorize(w, rank, "asvd", stats, alpha)
    scale = (x.abs().mean(0).clamp_min(1e-6) ** alpha)[:, None]
    tail = torch.linalg.svdvals(scale * w)[rank:]
    err = float(torch.linalg.norm(scale * (w - d.double() @ u.double())))
    assert abs(err - float(tail.square().sum().sqrt())) <= REL * float(torch.linalg.norm(scale * w))
    assert torch.allclose(spectrum(w, "asvd", stats, alpha), torch.linalg.svdvals(scale * w))


def test_streamed_statistics_equal_one_pass():
    x = torch.randn(50, 6, dtype=torch.float64)
    stats = _stats(x)
    assert torch.allclose(stats.gram, x.T @ x)
    assert torch.allclose(stats.abs_mean(), x.abs().mean(0))
    assert stats.tokens == 50


def test_whitening_without_a_shift_is_the_cholesky_factor():
    x = torch.randn(40, 5, dtype=torch.float64)
    white = whitening_from_gram(x.T @ x)
    assert white.shift == 0.0
    assert torch.allclose(white.factor @ white.factor.T, x.T @ x)


def test_methods_without_statistics_and_unknown_methods_fail_clearly():
    w = torch.randn(4, 3)
    for method, message in (("svd-llm", "calibration"), ("asvd", "calibration"), ("x", "unknown")):
        try:
            factorize(w, 2, method)
        except ValueError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"{method} without statistics was accepted")


def test_allocation_spends_the_budget_where_the_spectrum_is_flat():
    shapes = {"a": (16, 16), "b": (16, 16)}
    steep = torch.tensor([10.0, 5.0] + [1e-3] * 14, dtype=torch.float64)
    flat = torch.ones(16, dtype=torch.float64)
    spectra = {(0, "a"): steep, (0, "b"): flat}
    uniform = {(0, "a"): 4, (0, "b"): 4}
    budget = uniform_budget(uniform, shapes)
    alloc = allocate_ranks(spectra, shapes, budget)
    assert budget == 4 * 32 * 2
    assert alloc.ranks[(0, "a")] == 2  # its tail carries almost nothing
    assert alloc.ranks[(0, "b")] == 6
    assert alloc.used == budget


def test_allocation_stops_at_break_even_and_keeps_a_matrix_dense_past_it():
    """16×12: factors of rank 6 hold 168 of the matrix's 192 parameters, rank 7 would
    hold 196. With room, the flat matrix goes dense (24 more) instead of rank 7."""
    assert break_even_rank(16, 12) == 6 and break_even_rank(16, 12, 4) == 4
    assert break_even_rank(3, 2, 4) == 4  # at least one multiple
    shapes = {"a": (16, 12), "b": (16, 12)}
    steep = torch.tensor([10.0, 5.0] + [1e-3] * 10, dtype=torch.float64)
    flat = torch.ones(12, dtype=torch.float64)
    spectra = {(0, "a"): steep, (0, "b"): flat}
    alloc = allocate_ranks(spectra, shapes, 2 * 28 + 192)
    assert alloc.ranks == {(0, "a"): 2, (0, "b"): None}
    assert alloc.used == uniform_budget(alloc.ranks, shapes) == 2 * 28 + 192
    tight = allocate_ranks(spectra, shapes, 2 * 28 + 6 * 28 + 23)  # dense does not fit
    assert tight.ranks == {(0, "a"): 2, (0, "b"): 6}


@given(
    st.lists(st.tuples(st.integers(2, 20), st.integers(2, 20)), min_size=1, max_size=5),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
def test_allocation_respects_budget_bounds_and_multiples(shape_list, multiple, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {f"m{i}": s for i, s in enumerate(shape_list)}
    spectra, uniform = {}, {}
    for name, (n_in, n_out) in shapes.items():
        top = min(n_in, n_out)
        spectra[(0, name)] = (
            torch.rand(top, generator=g, dtype=torch.float64).sort(descending=True).values
        )
        uniform[(0, name)] = max(multiple, top // multiple * multiple // 2 or multiple)
    budget = uniform_budget(uniform, shapes)
    alloc = allocate_ranks(spectra, shapes, budget, multiple)
    assert alloc.used <= budget
    assert alloc.used == uniform_budget(alloc.ranks, shapes)
    for (_, name), r in alloc.ranks.items():
        if r is not None:  # dense only past break-even: never factors larger than the matrix
            assert r % multiple == 0 and multiple <= r <= break_even_rank(*shapes[name], multiple)
