"""Time candidate meta-parameters of generated kernels on a GPU and store the best.

Each job is one kernel file of a generated folder (family + shape key) and a list of
row buckets; each candidate is timed with CUDA-graph replay (many launches per
measurement, ``triton.testing.do_bench_cudagraph``). Candidates that fail to compile
or run out of resources are skipped. The budget is checked between candidates; when
it runs out, what has been measured is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from types import ModuleType

from tune.space import TUNABLE_FAMILIES, search_space
from tune.store import CONFIG_ROOT, config_path, write_table

Timer = Callable[[ModuleType, "TuneJob", int, dict], float]  # (module, job, rows, meta) -> ms


@dataclass(frozen=True)
class TuneJob:
    family: str
    shape_key: str
    file: str  # the kernel's file in the generated folder
    n: int
    k: int
    entry: tuple[str, str] | None = None  # (group, layer shape) in a file serving several

    def kernel(self, module):
        """What launches this job in ``module``: the shape's entry where the module serves
        several shapes (down_proj, latent_up), else the module."""
        return module.SHAPES[self.entry] if self.entry is not None else module

    def configs(self, module) -> dict:
        """The generated meta-parameters of this job, by row bucket."""
        if self.family == "gemm_fixed":
            return module.CONFIGS[(self.k, self.n)]
        return self.kernel(module).configs

    def path(self, device: str, root: Path = CONFIG_ROOT) -> Path:
        return config_path(device, self.family, self.shape_key, root)


def jobs_from_manifest(folder: Path, families: tuple[str, ...] = TUNABLE_FAMILIES) -> list[TuneJob]:
    """Tunable kernels of a generated folder with their GEMM dims (n, k)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    jobs = []
    for kernel in manifest["kernels"]:
        if kernel["family"] not in families or "configs" not in kernel:
            continue
        n, k = _dims(kernel)
        entry = (kernel["group"], kernel["shape_id"]) if "shape_id" in kernel else None
        jobs.append(TuneJob(kernel["family"], kernel["shape_key"], kernel["file"], n, k, entry))
    return jobs


def _dims(kernel: dict) -> tuple[int, int]:
    """(n, k) from the shape key: gemm 'k64_n9', down_proj 'k64_n26', latent_up 'c26_q27x32_...'."""
    key = kernel["shape_key"]
    if kernel["family"] == "latent_up":
        chunk = int(key.split("_")[0][1:])
        widths = [int(part.rsplit("x", 1)[1]) for part in key.split("_")[1:]]
        return max(widths), chunk
    parts = dict((p[0], int(p[1:])) for p in key.split("_"))
    return parts["n"], parts["k"]


def _best(
    job: TuneJob,
    module,
    rows: int,
    device: str,
    timer: Timer,
    deadline: float,
    dtype_bytes: int,
    progress,
) -> tuple[dict | None, float, bool]:
    """(fastest config, its ms, ran out of time) for one job at one row bucket."""
    best, best_ms = None, float("inf")
    for meta in search_space(job.n, job.k, rows, device, dtype_bytes):
        if time.monotonic() > deadline:
            return best, best_ms, True
        try:
            ms = timer(module, job, rows, meta)
        except Exception as exc:  # a config the device cannot run: skip it
            if progress:
                progress(f"skip {job.file} rows {rows} {meta}: {type(exc).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = meta, ms
    return best, best_ms, False


def tune(
    jobs: list[TuneJob],
    modules: dict[str, ModuleType],
    buckets: list[int],
    device: str,
    timer: Timer,
    budget_s: float,
    root: Path = CONFIG_ROOT,
    dtype_bytes: int = 2,
    progress: Callable[[str], None] | None = None,
) -> dict[TuneJob, dict[int, dict]]:
    """Best config per job and bucket within ``budget_s``; writes one file per job."""
    deadline = time.monotonic() + budget_s
    results: dict[TuneJob, dict[int, dict]] = {}
    out_of_time = False
    for job in jobs:
        table: dict[int, dict] = {}
        timings: dict[int, float] = {}
        for rows in buckets:
            best, best_ms, out_of_time = _best(
                job, modules[job.file], rows, device, timer, deadline, dtype_bytes, progress
            )
            if best is not None:
                table[rows], timings[rows] = best, best_ms
            if out_of_time:
                break
        if table:
            about = {
                "date": date.today().isoformat(),
                "device": device,
                "kernel": f"{job.file} {job.shape_key}",
                "milliseconds": {str(b): timings[b] for b in table},
            }
            write_table(job.path(device, root), table, about)
            results[job] = table
        if progress:
            progress(f"{job.file} {job.shape_key}: {len(table)} bucket(s) tuned")
        if out_of_time:
            break
    return results
