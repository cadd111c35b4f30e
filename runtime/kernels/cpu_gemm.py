"""The dynamic path's matrix products, tuned per machine: for every weight shape of the
model and every decode row bucket, the fastest of a few ways to compute ``a · W``.

Which form wins depends on the CPU, the BLAS torch was built with, the thread count and
the shape. Measured with weights streamed from memory (median of 5, 16 rows): on an AMD
EPYC (AVX2, one thread) the single GEMM call of ``F.linear`` ran at 18-22 GFLOP/s while
the product cut into 256-column blocks and run as one batched matmul ran at 39 (2048 x
11264: 41 ms -> 20 ms), and at 2-8 rows the transposed product (W · aᵀ)ᵀ was fastest; on
an Intel Xeon with AVX-512 (two threads) oneDNN with the weight reordered once into its
own blocked layout ran a 576 x 3072 product in 0.48 ms against 0.70 for MKL's single call
(MKL repacks the weight on every call, so at few rows its cost is the weight's streaming
plus its arithmetic, not the larger of the two), while at one or two rows MKL's call was
fastest, and with one thread per rank at 8 rows oneDNN reading the weight as stored won
several of cpu-demo's 2048-wide shapes. So the runner measures the candidates on the
model's own weights once at start-up (``time_cpu_gemm``, ``choose``) instead of trusting
a table written on another machine, and keeps a reordered copy of the weights whose shape
chose it (``CpuGemm.pack``).

Every form computes the same product (fp32 sums in a different order: results agree to
rounding, see ``tests/test_cpu_gemm.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from dsl.buckets import nearest_bucket
from runtime.kernels.eager import (
    ONEDNN_DTYPES,
    onednn_linear,
    stored_transposed,
    transposed_product,
)
from runtime.kernels.eager import matmul as default_matmul
from runtime.kernels.panel import panel_library

# Decode batches the table is measured at; a product of another row count takes the
# nearest bucket's form. Above 64 rows (prefill) every form ran within 16% of the others
# on the AMD EPYC below, so prefill keeps the untuned default.
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (128, 256, 512)  # column-block widths tried (each that divides N at least twice)
# Bytes of distinct weights one timing pass multiplies through: several times what a
# CPU's caches hold, so that every pass streams its weights from memory as a decode step
# does (each weight is used once per step, after the whole rest of the model). The AMD
# EPYC above has 32 MB of L3; on the Xeon a 64 MB buffer was read at 52 GB/s, from
# 128 MB on at 24-26 GB/s, the memory's rate. With 32 MB passes the Xeon timed its
# products from cache and chose forms 1.3x slower in a real step than the best. On the
# EPYC, passes of 32, 64, 128 and 256 MB timed each form within 5 % per matrix
# (576x25, 576x529, 192x576; 1, 8, 64 rows), so 128 MB, half of the 256 used before,
# halves start-up's tuning and stays at the memory's rate on both machines.
COLD_BYTES = 128 << 20
# oneDNN reorders a weight for a row count; from 4 rows on every count gives the same
# layout (576 x 3072 at 1-64 rows within 3%), one row a 1.5x slower one.
PACK_ROWS = 16
# A shape's reordering form takes every row bucket where it is within this factor of
# the fastest form: the weight is then kept in that form alone (``CpuGemm.release``),
# one copy instead of two, for a few percent in the buckets another form won.
SOLE_SLACK = 1.10


@dataclass(frozen=True)
class Form:
    """One way to compute a [M, K] · b [K, N], b stored [N, K]."""

    kind: str  # "mm" | "onednn" | "packed" | "panel" | "transposed" | "blocked"
    block: int = 0  # column-block width of "blocked"

    @property
    def name(self) -> str:
        return f"blocked{self.block}" if self.kind == "blocked" else self.kind

    @property
    def reads_strided_rows(self) -> bool:
        """Whether the form takes an ``a`` whose rows are apart by more than K (a column
        slice of a wider tensor) without a contiguous copy first."""
        return self.kind == "panel"

    @property
    def reorders(self) -> bool:
        """Whether the form multiplies by a copy of b in its own layout (``reorder``)."""
        return self.kind in ("packed", "panel")

    def reorder(self, b: torch.Tensor) -> torch.Tensor:
        """b's copy in this form's layout: oneDNN's blocks or the native kernel's panels."""
        return pack(b) if self.kind == "packed" else panel_library().pack(b)

    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``packed``: b reordered by ``reorder`` (the operand of the forms that reorder)."""
        if self.kind == "packed":
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        if self.kind == "panel":
            return panel_library().product(a, packed, b.shape[1])
        if self.kind == "onednn":  # the weight as stored, reordered by oneDNN per call
            return onednn_linear(a, b)
        if self.kind == "transposed":
            return transposed_product(a, b)
        if self.kind == "blocked":
            w = b.t()  # [N, K], contiguous
            n, k = w.shape
            blocks = w.view(n // self.block, self.block, k).transpose(1, 2)
            return torch.matmul(a, blocks).permute(1, 0, 2).reshape(a.shape[0], n)
        return torch.mm(a, b)  # MKL's single call, as F.linear makes it


@dataclass(frozen=True, eq=False)
class ReleasedMatrix:
    """What a model keeps in place of a matrix b [K, N] that a tuned gemm multiplies only
    in its reordered form (``CpuGemm.release``): b's shape and dtype, and the reordered
    copy. It is not a tensor, so anything but ``CpuGemm`` that would read b fails at
    once instead of reading something else."""

    shape: tuple[int, int]
    dtype: torch.dtype
    form: Form
    copy: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.copy.numel() * self.copy.element_size()

    def product(self, a: torch.Tensor) -> torch.Tensor:
        """a [M, K] · b, any M."""
        if a.dim() != 2 or a.shape[1] != self.shape[0] or a.dtype != self.dtype:
            raise ValueError(
                f"a product by a released {list(self.shape)} {self.dtype} matrix takes a "
                f"[M, {self.shape[0]}] {self.dtype} a, found {list(a.shape)} {a.dtype}"
            )
        a = a if self.form.reads_strided_rows else a.contiguous()
        return self.form(a, self, self.copy)  # type: ignore[arg-type]


def can_pack(b: torch.Tensor) -> bool:
    return (
        b.device.type == "cpu"
        and b.dtype in ONEDNN_DTYPES
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(b: torch.Tensor) -> torch.Tensor:
    """b [K, N] (stored [N, K]) in oneDNN's blocked layout, for the "packed" form."""
    return torch.ops.mkldnn._reorder_linear_weight(b.t(), PACK_ROWS)


def can_panel(b: torch.Tensor) -> bool:
    """Whether the native kernel (fp32 only) is built here and takes b."""
    return b.device.type == "cpu" and b.dtype == torch.float32 and panel_library() is not None


def forms_for(b: torch.Tensor, packing: bool = True) -> list[Form]:
    """The candidate forms for matrices like b [K, N] (``packing``: with the forms that
    keep a reordered copy of the weight, "packed" and "panel")."""
    n = b.shape[1]
    forms = [Form("mm"), Form("onednn"), Form("transposed")]
    forms += [Form("packed")] if packing and can_pack(b) else []
    forms += [Form("panel")] if packing and can_panel(b) else []
    return forms + [Form("blocked", c) for c in BLOCKS if n % c == 0 and n >= 2 * c]


def _key(kind: str, b: torch.Tensor) -> tuple[str, int, int, int]:
    return kind, b.data_ptr(), b.shape[0], b.shape[1]


@dataclass
class CpuGemm:
    """``a · b`` by the measured-fastest form for b's shape and a's row bucket; any
    product it was not tuned for (other shapes, strided or mixed-dtype operands, prefill
    rows) goes through ``runtime.kernels.eager.matmul``."""

    forms: dict[tuple[int, int, torch.dtype], dict[int, Form]] = field(default_factory=dict)
    # b's reordered copies by (form kind, address, K, N), for the matrices whose shape
    # uses a form that reorders
    packed: dict[tuple[str, int, int, int], torch.Tensor] = field(default_factory=dict)
    # The matrices kept only in their reordered form (``release``)
    released: list[ReleasedMatrix] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The form for every row count up to the last bucket, looked up once here rather
        # than on each of a step's products.
        rows = range(DECODE_ROWS[-1] + 1)
        self._by_rows = {
            key: [table[nearest_bucket(table, max(1, r))] for r in rows]
            for key, table in self.forms.items()
        }

    def pack(self, matrices: Iterable[torch.Tensor]) -> None:
        """Keep a reordered copy of each matrix for each form that reorders and that its
        shape chose for a bucket (the matrix itself stays: prefill and the other
        buckets' forms read it)."""
        for b in matrices:
            table = self.forms.get((b.shape[0], b.shape[1], b.dtype), {})
            for form in sorted({f for f in table.values() if f.reorders}, key=str):
                if stored_transposed(b):
                    self.packed[_key(form.kind, b)] = form.reorder(b)

    def sole_form(self, b: torch.Tensor) -> Form | None:
        """The reordering form b's shape uses in every bucket, where b has its copy: the
        only form b is then multiplied in (prefill rows included)."""
        forms = set(self.forms.get((b.shape[0], b.shape[1], b.dtype), {}).values())
        if len(forms) != 1:
            return None
        (form,) = forms
        if not form.reorders or _key(form.kind, b) not in self.packed:
            return None
        return form

    def release(self, b: torch.Tensor) -> ReleasedMatrix | None:
        """Where b is multiplied only in its reordered form (``sole_form``): hand b's
        copy to a ``ReleasedMatrix`` for the model to keep in b's place (b itself can
        then go). None where b must stay."""
        form = self.sole_form(b)
        if form is None:
            return None
        copy = self.packed.pop(_key(form.kind, b))
        released = ReleasedMatrix((b.shape[0], b.shape[1]), b.dtype, form, copy)
        self.released.append(released)
        return released

    def __call__(self, a: torch.Tensor, b: torch.Tensor | ReleasedMatrix) -> torch.Tensor:
        if isinstance(b, ReleasedMatrix):
            return b.product(a)
        by_rows = self._by_rows.get((b.shape[0], b.shape[1], b.dtype))
        if (
            by_rows is None
            or a.dim() != 2
            or a.shape[0] >= len(by_rows)
            or a.dtype != b.dtype
            or not stored_transposed(b)
        ):
            return default_matmul(a, b)
        form = by_rows[a.shape[0]]
        a = a if form.reads_strided_rows else a.contiguous()
        if not form.reorders:
            return form(a, b)
        packed = self.packed.get(_key(form.kind, b))
        if packed is None:  # a matrix of this shape that was not packed
            return default_matmul(a, b)
        return form(a, b, packed)

    def packed_bytes(self) -> int:
        """Memory the reordered copies take beside the matrices themselves (a released
        matrix's copy is no longer beside it: it is the matrix)."""
        return sum(p.numel() * p.element_size() for p in self.packed.values())

    def released_bytes(self) -> int:
        """Memory the released matrices' reordered copies take."""
        return sum(r.nbytes for r in self.released)

    def describe(self) -> dict[str, dict[str, str]]:
        """{"KxN": {rows: form}} for benchmark reports."""
        return {
            f"{k}x{n}": {str(rows): form.name for rows, form in table.items()}
            for (k, n, _), table in sorted(self.forms.items(), key=lambda kv: kv[0][:2])
        }


ShapeKey = tuple[int, int, torch.dtype]
Timings = dict[ShapeKey, dict[int, dict[Form, float]]]


def _pass_time(
    form: Form, a: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor | None]
) -> float:
    start = time.perf_counter()
    for b, p in zip(weights, packed, strict=True):
        form(a, b, p)
    return time.perf_counter() - start


def _time_forms(
    forms: list[Form],
    weights: list[torch.Tensor],
    copies: dict[Form, list[torch.Tensor | None]],
    rows: int,
    reps: int,
) -> dict[Form, float]:
    """Median pass time of every form, the forms interleaved per repetition (so a drift
    of the machine's speed hits them all alike); ``copies``: the weights as each form
    that reorders keeps them."""
    a = torch.randn(rows, weights[0].shape[0], dtype=weights[0].dtype)
    times: dict[Form, list[float]] = {f: [] for f in forms}
    for f in forms:  # warm-up: oneDNN builds its primitive on the first call of a shape
        f(a, weights[0], copies[f][0])
    for _ in range(reps):
        for f in forms:
            times[f].append(_pass_time(f, a, weights, copies[f]))
    return {f: statistics.median(t) for f, t in times.items()}


def nbytes_of(b: torch.Tensor) -> int:
    return b.numel() * b.element_size()


def group_by_shape(matrices: Iterable[torch.Tensor]) -> dict[ShapeKey, list[torch.Tensor]]:
    """The matrices tuned products take (CPU, b [K, N] views of [N, K]), by shape."""
    groups: dict[ShapeKey, list[torch.Tensor]] = {}
    for b in matrices:
        if b.device.type == "cpu" and b.dim() == 2 and stored_transposed(b):
            groups.setdefault((b.shape[0], b.shape[1], b.dtype), []).append(b)
    return groups


def _cold_sample(mats: list[torch.Tensor], target: int) -> list[torch.Tensor]:
    """At least ``target`` bytes of distinct matrices of one shape: the model's own, then
    copies of them (a pass that met the same matrix twice would time it from cache)."""
    count = max(1, math.ceil(target / nbytes_of(mats[0])))
    sample = mats[:count]
    while len(sample) < count:
        sample.append(mats[len(sample) % len(mats)].t().clone().t())
    return sample


def time_cpu_gemm(
    matrices: Iterable[torch.Tensor],
    rows: tuple[int, ...] = DECODE_ROWS,
    reps: int = 2,
    cold_bytes: int = COLD_BYTES,
    packing: bool = True,
    target_bytes: int | None = None,
) -> Timings:
    """Every form timed on the model's own matrices (b [K, N] views of [N, K] storage,
    as the dynamic path keeps them), per distinct shape and row bucket. Each pass reads
    ``cold_bytes`` of distinct matrices, or the whole model's where that is less: a model
    that fits in the caches is multiplied from them in a real step too (``target_bytes``:
    the bytes a pass reads, where ``matrices`` are only some of the model's). ``packing``:
    "packed" among the forms (its choice keeps a reordered copy of the weights)."""
    groups = group_by_shape(matrices)
    target = target_bytes or min(cold_bytes, sum(nbytes_of(b) for g in groups.values() for b in g))
    timings: Timings = {}
    with torch.inference_mode():
        for key, mats in sorted(groups.items(), key=lambda kv: kv[0][:2]):
            sample = _cold_sample(mats, target)
            forms = forms_for(sample[0], packing)
            unordered: list[torch.Tensor | None] = [None] * len(sample)
            copies = {  # made once for all rows
                f: [f.reorder(b) for b in sample] if f.reorders else unordered for f in forms
            }
            timings[key] = {r: _time_forms(forms, sample, copies, r, reps) for r in rows}
            del sample, copies
    return timings


def _fastest(per_rows: dict[int, dict[Form, float]]) -> dict[int, Form]:
    """The fastest form per row bucket of one shape, with at most one of the forms that
    reorder (each keeps a whole copy of the weights): the one that more buckets chose,
    or, tied, the one of least summed time. On the Xeon, oneDNN's "packed" won only the
    64-row bucket of shapes where "panel" won the rest, and would have doubled the
    copies' memory for it."""
    best = {r: min(fs, key=fs.__getitem__) for r, fs in per_rows.items()}
    reordering = {f for f in best.values() if f.reorders}
    if len(reordering) <= 1:
        return best

    def preference(form: Form) -> tuple[int, float]:
        won = sum(f == form for f in best.values())
        return -won, sum(fs[form] for fs in per_rows.values())

    kept = min(reordering, key=preference)
    return {
        r: min((f for f in fs if f == kept or not f.reorders), key=fs.__getitem__)
        for r, fs in per_rows.items()
    }


def _sole(per_rows: dict[int, dict[Form, float]], best: dict[int, Form]) -> dict[int, Form]:
    """``best`` with its reordering form in every bucket, where that form is within
    ``SOLE_SLACK`` of each bucket's fastest: the weight then needs no other copy."""
    reordering = {f for f in best.values() if f.reorders}
    if len(reordering) != 1:
        return best
    (form,) = reordering
    close = all(fs[form] <= SOLE_SLACK * fs[best[r]] for r, fs in per_rows.items())
    return dict.fromkeys(best, form) if close else best


def choose(timings: Timings, panel_shapes: Iterable[ShapeKey] = ()) -> CpuGemm:
    """The fastest form per shape and row bucket (``_fastest``), a reordering form in
    every bucket where it is nearly the fastest in each (``_sole``); ``panel_shapes``,
    untimed, take the native panels in every bucket (the native decode block multiplies
    them so, ``runtime.model.decode_block``)."""
    forms = {key: _sole(per_rows, _fastest(per_rows)) for key, per_rows in timings.items()}
    forms |= {key: dict.fromkeys(DECODE_ROWS, Form("panel")) for key in panel_shapes}
    return CpuGemm(forms)
