"""The dynamic path's tuned products (``runtime.kernels.cpu_gemm``): every form equals
the plain product over hypothesis shapes (fp32 to 1e-4 and bf16 to 2e-2 of the output's
scale: each form sums in its own order), the tuned table falls back to the default for
what it was not measured on, only the shapes that chose the reordered weight keep one,
timing passes read distinct matrices, and the ranks of a group choose the same forms."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.dist.launcher import launch
from runtime.kernels import eager
from runtime.kernels.cpu_gemm import (
    DECODE_ROWS,
    CpuGemm,
    Form,
    ReleasedMatrix,
    _cold_sample,
    can_pack,
    choose,
    forms_for,
    time_cpu_gemm,
)
from tests.tp_workers import tune_gemm_shared

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _stored_transposed(k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, k).to(dtype).t()  # b [K, N], stored [N, K] as the runner keeps it


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = want.float().abs().max().item() + 1e-6
    return (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale


@given(
    rows=st.integers(1, 80),
    k=st.integers(1, 300),
    blocks=st.integers(2, 5),
    width=st.sampled_from([128, 256]),
    extra=st.sampled_from([0, 0, 1, 17]),  # N not a multiple of any block: no blocked form
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_form_computes_the_product(rows, k, blocks, width, extra, dtype):
    n = blocks * width + extra
    a = torch.randn(rows, k).to(dtype)
    b = _stored_transposed(k, n, dtype)
    want = a.float() @ b.float()
    forms = forms_for(b)
    assert any(f.kind == "blocked" for f in forms) == (extra == 0)
    assert any(f.kind == "packed" for f in forms) == can_pack(b)
    assert any(f.kind == "panel" for f in forms) == (dtype == torch.float32)
    for form in forms:
        got = form(a, b, form.reorder(b) if form.reorders else None)
        assert got.shape == (rows, n) and got.dtype == dtype, form
        assert _close(got, want, dtype), form


def test_blocked_forms_need_at_least_two_whole_blocks():
    packed = ["packed"] if can_pack(_stored_transposed(4, 512, torch.float32)) else []
    names = ["mm", "onednn", "transposed", *packed, "panel"]
    assert [f.name for f in forms_for(_stored_transposed(4, 512, torch.float32))] == [
        *names,
        "blocked128",
        "blocked256",
    ]
    assert [f.name for f in forms_for(_stored_transposed(4, 300, torch.float32))] == names


class _Recording:
    """A form that records the rows it was called with."""

    def __init__(self, form: Form) -> None:
        self.form, self.kind, self.rows = form, form.kind, []
        self.reorders, self.reads_strided_rows = form.reorders, form.reads_strided_rows

    def __call__(self, a: torch.Tensor, b: torch.Tensor, packed=None) -> torch.Tensor:
        self.rows.append(a.shape[0])
        return self.form(a, b, packed)


def test_a_tuned_table_takes_the_nearest_bucket_and_falls_back_otherwise():
    b = _stored_transposed(64, 512, torch.float32)
    few, many = _Recording(Form("transposed")), _Recording(Form("blocked", 128))
    table = {r: many if r >= 8 else few for r in DECODE_ROWS}
    gemm = CpuGemm({(64, 512, torch.float32): table})
    for rows in (1, 3, 9, 64):
        a = torch.randn(rows, 64)
        assert _close(gemm(a, b), a @ b, torch.float32)
    assert few.rows == [1, 3] and many.rows == [9, 64]
    # prefill rows, another shape, a strided matrix, mixed dtypes: the untuned default
    strided = torch.randn(1024, 64).t()[:, ::2]
    cases = [
        (torch.randn(100, 64), b),
        (torch.randn(5, 64), _stored_transposed(64, 256, torch.float32)),
        (torch.randn(5, 64), strided),
        (torch.randn(5, 64).double(), b.double()),
    ]
    for a, m in cases:
        assert torch.equal(gemm(a, m), eager.matmul(a, m))
    assert few.rows == [1, 3] and many.rows == [9, 64]


def test_only_the_shapes_that_chose_the_reordered_weight_keep_one():
    """The "packed" form multiplies by the matrix's reordered copy, made by ``pack`` for
    each matrix whose shape chose it in some bucket; a matrix of that shape with no copy
    (and every other shape) takes its own form or the default."""
    b, other = (
        _stored_transposed(64, 512, torch.float32),
        _stored_transposed(64, 256, torch.float32),
    )
    assert can_pack(b), "this torch has no oneDNN reorder (x86 CPU builds have it)"
    table = {r: Form("packed") if r >= 8 else Form("mm") for r in DECODE_ROWS}
    gemm = CpuGemm({(64, 512, torch.float32): table, (64, 256, torch.float32): {1: Form("mm")}})
    gemm.pack([b, other])
    assert list(gemm.packed) == [("packed", b.data_ptr(), 64, 512)]
    assert gemm.packed_bytes() >= b.numel() * b.element_size()
    for rows in (3, 9, 40):
        a = torch.randn(rows, 64)
        assert _close(gemm(a, b), a @ b, torch.float32)
    unpacked = _stored_transposed(64, 512, torch.float32)  # same shape, never packed
    a = torch.randn(9, 64)
    assert torch.equal(gemm(a, unpacked), eager.matmul(a, unpacked))


def test_a_timing_pass_reads_distinct_matrices():
    """Copies of the model's matrices make up the bytes asked for (no matrix twice in a
    pass); the model's own come first, none copied where they are enough."""
    mats = [_stored_transposed(32, 64, torch.float32) for _ in range(3)]
    size = 32 * 64 * 4
    sample = _cold_sample(mats, 7 * size)
    assert len(sample) == 7 and sample[:3] == mats
    assert len({m.data_ptr() for m in sample}) == 7
    assert all(m.shape == (32, 64) and m.stride() == (1, 32) for m in sample)
    assert all(torch.equal(m, mats[i % 3]) for i, m in enumerate(sample))
    assert _cold_sample(mats, 2 * size) == mats[:2]


def test_tuning_measures_every_shape_and_bucket_once():
    mats = [_stored_transposed(32, 256, torch.float32) for _ in range(3)]
    mats.append(_stored_transposed(256, 32, torch.float32))
    mats.append(torch.randn(32, 256))  # stored [in, out]: not a dynamic-path matrix
    timings = time_cpu_gemm(mats, rows=(1, 16), reps=1)
    assert sorted(key[:2] for key in timings) == [(32, 256), (256, 32)]
    for (_, n, _), per_rows in timings.items():
        assert sorted(per_rows) == [1, 16]
        for times in per_rows.values():
            assert set(times) == set(forms_for(mats[0] if n == 256 else mats[3]))
            assert all(t > 0 for t in times.values())
    table = choose(timings).describe()
    assert set(table) == {"32x256", "256x32"}
    assert set(table["256x32"]) == {"1", "16"}
    assert all(name in {f.name for f in forms_for(mats[0])} for name in table["32x256"].values())


def test_the_ranks_of_a_machine_tune_together_and_choose_the_same_forms():
    same = [[(64, 512), (128, 256)]] * 2
    (table0, counts0, t0), (table1, counts1, t1) = launch(
        tune_gemm_shared, 2, same, 16, timeout_s=120
    )
    assert table0 == table1 and t0 == t1  # one timing per shape, shared
    assert counts0[:3] == counts1[:3] == (2, 2, 2)
    assert counts0[3] + counts1[3] == 2  # the two shapes dealt out, one to each rank
    uneven = [[(64, 512)], [(64, 256)]]  # a shard split unevenly: each its own shape
    results = launch(tune_gemm_shared, 2, uneven, 16, timeout_s=120)
    assert set(results[0][0]) == {"64x512"} and set(results[1][0]) == {"64x256"}
    assert [r[1] for r in results] == [(1, 2, 2, 1), (1, 2, 2, 1)]


def test_the_budget_bounds_a_machine_not_a_rank():
    """Two ranks with 30 shapes of their own each: the machine times at most the budget."""
    shapes = [[(64 + 2 * i + rank, 48) for i in range(30)] for rank in range(2)]
    results = launch(tune_gemm_shared, 2, shapes, 6, timeout_s=120)
    (_, (shapes0, classes, timed, here0), _), (_, (_, _, _, here1), _) = results
    assert shapes0 == 30 and 1 <= classes <= 6 and timed == classes
    assert here0 + here1 == timed and abs(here0 - here1) <= 1


def test_tuning_without_packing_never_offers_the_reordered_weight():
    mats = [_stored_transposed(32, 256, torch.float32) for _ in range(2)]
    timings = time_cpu_gemm(mats, rows=(1, 8), reps=1, packing=False)
    assert all(f.kind != "packed" for t in timings.values() for fs in t.values() for f in fs)
    gemm = choose(timings)
    gemm.pack(mats)
    assert gemm.packed == {} and gemm.packed_bytes() == 0


def test_tuned_and_untuned_engines_give_the_same_greedy_tokens(tmp_path):
    """The tuned forms change only the order of fp32 sums: every mode's greedy tokens
    match the untuned engine's, with and without reordered weights (tp 2: the ranks tune
    together)."""
    from runtime.engine import LLM, SamplingParams
    from tests.hardening import hardening_model

    spec, ckpt = hardening_model(tmp_path)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=6)
    for mode in ("deinfer", "dense"):
        tokens = []
        for tune, packing in ((True, True), (True, False), (False, False)):
            with LLM(spec, ckpt, tp=2, mode=mode, tune_gemm=tune, pack_weights=packing) as llm:
                tokens.append([o.token_ids for o in llm.generate(prompts, params)])
                forms = llm.workers.call("gemm_forms")[0]
                assert bool(forms) == tune, "tuned iff asked"
                if not packing:
                    assert llm.workers.call("packed_weight_bytes") == [0, 0]
                    assert "packed" not in {f for t in forms.values() for f in t.values()}
        assert tokens[0] == tokens[1] == tokens[2], mode


@pytest.mark.parametrize("kind", ["panel", "packed"])
def test_a_matrix_multiplied_in_one_reordered_form_is_kept_in_it_alone(kind):
    """``release`` hands a matrix that every bucket multiplies in one reordered form (the
    panels or oneDNN's blocks) to a ``ReleasedMatrix`` (its copy, no tensor): products by
    it, at decode and prefill row counts, equal the plain product; a matrix of a shape
    that mixes forms, or one never packed, is not released; anything but the gemm fails
    to read it."""
    b, mixed = (
        _stored_transposed(64, 96, torch.float32),
        _stored_transposed(64, 80, torch.float32),
    )
    assert kind != "packed" or can_pack(b), "this torch has no oneDNN reorder"
    panel = dict.fromkeys(DECODE_ROWS, Form(kind))
    gemm = CpuGemm(
        {
            (64, 96, torch.float32): panel,
            (64, 80, torch.float32): {**panel, 64: Form("mm")},
        }
    )
    gemm.pack([b, mixed])
    assert gemm.release(mixed) is None  # its 64-row bucket reads the matrix as stored
    assert gemm.release(_stored_transposed(64, 96, torch.float32)) is None  # never packed
    beside = gemm.packed_bytes()
    released = gemm.release(b)
    assert isinstance(released, ReleasedMatrix) and released.shape == (64, 96)
    assert gemm.packed_bytes() < beside and gemm.released_bytes() >= b.numel() * 4
    for rows in (1, 7, 64, 65, 600):  # decode buckets and prefill rows alike
        a = torch.randn(rows, 64)
        assert _close(gemm(a, released), a @ b, torch.float32), rows
    with pytest.raises(ValueError, match=r"\[M, 64\] torch.float32 a, found \[3, 32\]"):
        gemm(torch.randn(3, 32), released)
    with pytest.raises((TypeError, AttributeError)):  # not a tensor: nothing reads it
        eager.matmul(torch.randn(3, 64), released)


def test_a_reordering_form_takes_every_bucket_only_where_it_is_nearly_the_fastest():
    mm, panel = Form("mm"), Form("panel")
    near = {1: {mm: 1.0, panel: 1.08}, 8: {mm: 2.0, panel: 1.0}, 16: {mm: 3.0, panel: 1.5}}
    far = {**near, 1: {mm: 1.0, panel: 1.2}}
    gemm = choose({(64, 96, torch.float32): near, (64, 80, torch.float32): far})
    assert set(gemm.forms[(64, 96, torch.float32)].values()) == {panel}
    assert gemm.forms[(64, 80, torch.float32)] == {1: mm, 8: panel, 16: panel}
