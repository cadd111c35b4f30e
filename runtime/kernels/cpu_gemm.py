"""The dynamic path's matrix products, tuned per machine: for every weight shape of the
model and every decode row bucket, the fastest of a few ways to compute ``a · W``.

Measured here (AMD EPYC, AVX2, one thread, a [16, 2048] activation against weights
streamed from memory, median of 5): the single GEMM call that torch makes for
``F.linear`` or ``torch.mm`` runs at 18-22 GFLOP/s whatever the layout, while the same
product split into 256-column blocks and run as one batched matmul runs at 39 GFLOP/s
(2048 x 11264: 41 ms -> 20 ms); for a 5632 x 2048 weight the gain is 1.14x, at one row
none, and at 2-8 rows the transposed product (W · aᵀ)ᵀ is fastest. Which form wins
depends on the CPU, the BLAS torch was built with, the thread count and the shape, so the
runner measures the candidates on the model's own weights once at start-up
(``time_cpu_gemm``, ``choose``) instead of trusting a table written on another machine.

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
import torch.distributed as dist

from dsl.buckets import nearest_bucket
from runtime.kernels.eager import matmul as default_matmul
from runtime.kernels.eager import onednn_linear, stored_transposed, transposed_product

# Decode batches the table is measured at; a product of another row count takes the
# nearest bucket's form. Above 64 rows (prefill) every form ran within 16% of the others
# here, so prefill keeps the untuned default.
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (128, 256, 512)  # column-block widths tried (each that divides N at least twice)
# Bytes of weights one timing pass multiplies through: as much as this CPU's L3 (32 MB),
# so every pass streams the weights from memory as a decode step does.
COLD_BYTES = 32 << 20


@dataclass(frozen=True)
class Form:
    """One way to compute a [M, K] · b [K, N], b stored [N, K]."""

    kind: str  # "onednn" | "transposed" | "blocked"
    block: int = 0  # column-block width of "blocked"

    @property
    def name(self) -> str:
        return f"blocked{self.block}" if self.kind == "blocked" else self.kind

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.kind == "transposed":
            return transposed_product(a, b)
        if self.kind == "blocked":
            w = b.t()  # [N, K], contiguous
            n, k = w.shape
            blocks = w.view(n // self.block, self.block, k).transpose(1, 2)
            return torch.matmul(a, blocks).permute(1, 0, 2).reshape(a.shape[0], n)
        return onednn_linear(a, b)


def forms_for(n: int) -> list[Form]:
    forms = [Form("onednn"), Form("transposed")]
    return forms + [Form("blocked", c) for c in BLOCKS if n % c == 0 and n >= 2 * c]


@dataclass
class CpuGemm:
    """``a · b`` by the measured-fastest form for b's shape and a's row bucket; any
    product it was not tuned for (other shapes, strided or mixed-dtype operands) goes
    through ``runtime.kernels.eager.matmul``."""

    forms: dict[tuple[int, int, torch.dtype], dict[int, Form]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The form for every row count up to the last bucket, looked up once here rather
        # than on each of a step's products.
        rows = range(DECODE_ROWS[-1] + 1)
        self._by_rows = {
            key: [table[nearest_bucket(table, max(1, r))] for r in rows]
            for key, table in self.forms.items()
        }

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        by_rows = self._by_rows.get((b.shape[0], b.shape[1], b.dtype))
        if (
            by_rows is None
            or a.dim() != 2
            or a.shape[0] >= len(by_rows)
            or a.dtype != b.dtype
            or not stored_transposed(b)
        ):
            return default_matmul(a, b)
        return by_rows[a.shape[0]](a.contiguous(), b)

    def describe(self) -> dict[str, dict[str, str]]:
        """{"KxN": {rows: form}} for benchmark reports."""
        return {
            f"{k}x{n}": {str(rows): form.name for rows, form in table.items()}
            for (k, n, _), table in sorted(self.forms.items(), key=lambda kv: kv[0][:2])
        }


Timings = dict[tuple[int, int, torch.dtype], dict[int, dict[Form, float]]]


def _pass_time(form: Form, a: torch.Tensor, weights: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for b in weights:
        form(a, b)
    return time.perf_counter() - start


def _time_forms(weights: list[torch.Tensor], rows: int, reps: int) -> dict[Form, float]:
    """Median pass time of every form, the forms interleaved per repetition (so a drift
    of the machine's speed hits them all alike)."""
    k, n = weights[0].shape
    a = torch.randn(rows, k, dtype=weights[0].dtype)
    forms = forms_for(n)
    times: dict[Form, list[float]] = {f: [] for f in forms}
    for f in forms:  # warm-up: oneDNN builds its primitive on the first call of a shape
        f(a, weights[0])
    for _ in range(reps):
        for f in forms:
            times[f].append(_pass_time(f, a, weights))
    return {f: statistics.median(t) for f, t in times.items()}


def time_cpu_gemm(
    matrices: Iterable[torch.Tensor], rows: tuple[int, ...] = DECODE_ROWS, reps: int = 2
) -> Timings:
    """Every form timed on the model's own matrices (b [K, N] views of [N, K] storage,
    as the dynamic path keeps them), per distinct shape and row bucket."""
    groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for b in matrices:
        if b.device.type == "cpu" and b.dim() == 2 and stored_transposed(b):
            groups.setdefault((b.shape[0], b.shape[1], b.dtype), []).append(b)
    timings: Timings = {}
    with torch.inference_mode():
        for key, mats in sorted(groups.items(), key=lambda kv: kv[0][:2]):
            per_pass = max(1, math.ceil(COLD_BYTES / (mats[0].numel() * mats[0].element_size())))
            sample = [mats[i % len(mats)] for i in range(min(per_pass, 4 * len(mats)))]
            timings[key] = {r: _time_forms(sample, r, reps) for r in rows}
    return timings


def sum_over_ranks(timings: Timings, group: dist.ProcessGroup | None = None) -> Timings:
    """The ranks' timings summed, where every rank timed the same shapes: the ranks of a
    tensor-parallel group then choose the same forms, by their combined cost (a step
    waits for the slowest rank, and one rank's noisy timing no longer decides alone)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return timings
    layout = [(key[:2], r, f.name) for key, t in timings.items() for r, fs in t.items() for f in fs]
    layouts: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, layout, group=group)
    if any(other != layout for other in layouts):
        return timings  # uneven shards: each rank keeps its own choice
    flat = torch.tensor([v for t in timings.values() for fs in t.values() for v in fs.values()])
    dist.all_reduce(flat, group=group)
    values = iter(flat.tolist())
    return {
        key: {r: {f: next(values) for f in fs} for r, fs in t.items()} for key, t in timings.items()
    }


def choose(timings: Timings) -> CpuGemm:
    """The fastest form per shape and row bucket."""
    return CpuGemm(
        {key: {r: min(fs, key=fs.__getitem__) for r, fs in t.items()} for key, t in timings.items()}
    )
