"""``deinfer-tune`` / ``deinfer tune``: tune a spec's generated kernels on this GPU, or
(``--checkpoint``) fill this CPU's tuning cache for a checkpoint ahead of time."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dsl import load_spec
from dsl.errors import UserError
from dsl.layout import LAYOUTS, OPTIMIZED
from runtime.kernels.gemm_tuning import DEFAULT_BUDGET
from tune.space import TUNABLE_FAMILIES, search_space, shared_memory_limit
from tune.store import CONFIG_ROOT, normalise_device_name


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="path to a YAML spec")
    p.add_argument(
        "--kernels",
        default=",".join(TUNABLE_FAMILIES),
        help=f"families to tune (default: {','.join(TUNABLE_FAMILIES)})",
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="row buckets, e.g. 1,2,4,...,256 (default: the spec's decode batch "
        "sizes plus 512 and 2048 prefill tokens)",
    )
    p.add_argument("--budget-s", type=float, default=600.0, help="stop after this many seconds")
    p.add_argument("--device-name", default=None, help="default: this machine's GPU")
    p.add_argument("--out-root", type=Path, default=CONFIG_ROOT, help="config store root")
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="CPU: time this checkpoint's products as a start-up would and keep the timings "
        "in the tuning cache ($DEINFER_CACHE_DIR), so that a start with the same --tp, "
        "--threads and --tune-budget times nothing",
    )
    p.add_argument("--tp", type=int, default=None, help="with --checkpoint (default: the spec's)")
    p.add_argument("--threads", type=int, default=None, help="with --checkpoint: per rank")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=OPTIMIZED,
        help="with --checkpoint: deinfer's matrix layout the start will run (default optimized)",
    )
    p.add_argument(
        "--tune-budget",
        type=int,
        default=DEFAULT_BUDGET,
        help=f"with --checkpoint: shapes timed at most per machine (default {DEFAULT_BUDGET})",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the search space and the files it would write; time nothing",
    )


def run_tune(args: argparse.Namespace) -> int:
    """CPU tuning cache (``--checkpoint``) or the GPU kernels' meta-parameters."""
    return fill_cpu_cache(args) if args.checkpoint is not None else tune_gpu_kernels(args)


def tune_gpu_kernels(args: argparse.Namespace) -> int:
    import torch

    from codegen.generate import generate, write_atomically
    from tune.tuner import jobs_from_manifest, tune

    spec = load_spec(args.spec)
    device = args.device_name or (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    )
    if device is None:
        raise UserError("no GPU here and no --device-name: give one (with --dry-run to plan)")
    if not args.dry_run and not torch.cuda.is_available():
        raise UserError("timing needs a GPU; use --dry-run to list the search space here")
    families = tuple(f for f in args.kernels.split(",") if f)
    unknown = [f for f in families if f not in TUNABLE_FAMILIES]
    if unknown:
        raise UserError(f"--kernels: {unknown[0]} is not one of {', '.join(TUNABLE_FAMILIES)}")
    gen = generate(spec)
    rt = gen.spec.runtime
    buckets = (
        [int(b) for b in args.batch_sizes.split(",")]
        if args.batch_sizes
        else sorted({*rt.cuda_graph_batch_sizes, 512, 2048})
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / gen.spec.name
        write_atomically(gen.files, folder)
        jobs = jobs_from_manifest(folder, families)
        if args.dry_run:
            _print_plan(jobs, buckets, device, args.out_root)
            return 0
        from runtime.kernels.loader import load_generated
        from tune.gpu_timer import cuda_graph_timer

        registry = load_generated(folder)
        package = registry.__name__.rsplit(".", 1)[0]
        modules = {
            job.file: sys.modules[f"{package}.{job.file.removesuffix('.py')}"] for job in jobs
        }
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="tune", unit="kernel")
        results = tune(
            jobs,
            modules,
            buckets,
            device,
            cuda_graph_timer(),
            args.budget_s,
            root=args.out_root,
            progress=lambda msg: (bar.set_postfix_str(msg[:40]), bar.update(0)),
        )
        bar.close()
    print(
        f"tuned {len(results)} of {len(jobs)} kernels for {normalise_device_name(device)}; "
        f"regenerate with deinfer-gen {args.spec} --device-name '{device}'"
    )
    return 0


def fill_cpu_cache(args: argparse.Namespace) -> int:
    """Start the engine once with the tuning cache on, and close it: what it timed stays."""
    from runtime.engine.config import EngineOptions
    from runtime.engine.llm import LLM
    from runtime.kernels.gemm_tuning import cache_dir

    options = EngineOptions(
        tp=args.tp, threads=args.threads, tune_budget=args.tune_budget, layout=args.layout
    )
    with LLM(str(args.spec), str(args.checkpoint), options) as llm:
        report, tp = llm.tuning(), llm.spec.parallel.tp
    print(f"{report.describe()}; kept in {cache_dir()} for starts at tp {tp}")
    return 0


def _print_plan(jobs, buckets, device: str, root: Path) -> None:
    print(
        f"device {normalise_device_name(device)} (shared memory limit "
        f"{shared_memory_limit(device)} B), buckets {buckets}"
    )
    total = 0
    for job in jobs:
        sizes = [len(search_space(job.n, job.k, b, device)) for b in buckets]
        total += sum(sizes)
        print(
            f"  {job.file}: n={job.n} k={job.k}, candidates per bucket {sizes} -> "
            f"{job.path(device, root)}"
        )
    print(
        f"{len(jobs)} kernels, {total} timings; not tunable (fixed launch): kv_copy, rope, "
        "paged_attention"
    )


def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="autotune generated kernels on this GPU")
    add_tune_arguments(p)
    p.set_defaults(func=run_tune)
