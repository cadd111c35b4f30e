"""The engine options ``deinfer run`` and ``deinfer serve`` share, and the engine they
open with them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsl.layout import LAYOUTS, OPTIMIZED
from dsl.plan import DOWN_LAYOUTS, MODES, UP_LAYOUTS
from runtime.dist.launcher import HEARTBEAT_S
from runtime.engine.config import EngineOptions


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--tp", type=int, default=None, help="default: the spec's")
    p.add_argument("--mode", choices=MODES, default="deinfer")
    p.add_argument("--kv-cache", choices=("dense", "latent", "auto"), default=None)
    p.add_argument(
        "--backend",
        choices=("triton", "torch"),
        default=None,
        help="static path's kernels; default: triton on a GPU, torch on a CPU",
    )
    p.add_argument(
        "--path",
        choices=("static", "dynamic"),
        default=None,
        help="static: fixed buffers and CUDA graphs (default on a GPU); dynamic: shapes follow "
        "the batch, plain torch (default on a CPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="threads per rank (cores // tp)")
    _add_tuning_arguments(p)
    p.add_argument(
        "--up-layout",
        choices=("auto", *UP_LAYOUTS),
        default="auto",
        help="deinfer: hold the o/down up factors replicated (the paper) or sharded with an "
        "all-gather of the output; auto: sharded where the ranks share memory",
    )
    p.add_argument(
        "--down-layout",
        choices=("auto", *DOWN_LAYOUTS),
        default="auto",
        help="deinfer: split the column groups' down factors and all-gather the latent (the "
        "paper), or hold them whole on every rank (no all-gather, more bytes); auto: the "
        "optimized layout's cost model chooses (dynamic path)",
    )
    _add_layout_arguments(p)
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE[,LATENCY]",
        help="run the ranks in network namespaces behind an emulated link, e.g. 200mbit "
        "(tc units; needs root and iproute2)",
    )
    _add_safety_arguments(p)


def _add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """Which of deinfer's matrices run merged (D·U, a dense shard) and which latent."""
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=OPTIMIZED,
        help="deinfer: each matrix merged or latent as the cost model predicts faster "
        "(optimized, default), or every decomposed matrix latent as in the paper (paper)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="device profile the optimized layout is chosen for (a name in tune/profiles "
        "or a .yaml path; default cpu-here on a CPU, a800-nvlink on a GPU)",
    )
    p.add_argument(
        "--plan-batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="decode rows the optimized layout is chosen for (default: the max batch)",
    )


def _add_tuning_arguments(p: argparse.ArgumentParser) -> None:
    """How the dynamic path measures its products at start-up."""
    p.add_argument(
        "--no-gemm-tuning",
        dest="tune_gemm",
        action="store_false",
        help="dynamic path: skip measuring the fastest product form per weight shape at "
        "start-up (a few seconds for a 1 GB model) and use the default forms",
    )
    p.add_argument(
        "--tune-budget",
        type=int,
        default=16,
        metavar="SHAPES",
        help="dynamic path: weight shapes timed at most at start-up; the others take the "
        "forms of the nearest timed shape (default 16)",
    )
    p.add_argument(
        "--no-tune-cache",
        dest="tune_cache",
        action="store_false",
        help="time every shape again instead of reading and writing the tuning cache "
        "(DEINFER_CACHE_DIR, default ~/.cache/deinfer)",
    )
    p.add_argument(
        "--no-weight-packing",
        dest="pack_weights",
        action="store_false",
        help="dynamic path: tune without reordered weights (oneDNN's blocks, the native "
        "panels), which otherwise replace or sit beside the weights; slower from 2 rows on",
    )


def _add_safety_arguments(p: argparse.ArgumentParser) -> None:
    """How much the engine trusts its checkpoint and its ranks."""
    p.add_argument(
        "--allow-extreme-weights",
        action="store_true",
        help="load a checkpoint whose weights hold absurd magnitudes (above 65504, or 1e4 "
        "times their tensor's RMS) with a warning instead of refusing it",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds a rank may go silent (stopped, hung, its machine or link lost) before "
        "the engine stops naming it (default 15)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The ``EngineOptions`` the command line's options say."""
    return EngineOptions(
        tp=args.tp,
        mode=args.mode,
        kv_cache=args.kv_cache,
        backend=args.backend,
        path=args.path,
        threads=args.threads,
        tune_gemm=args.tune_gemm,
        pack_weights=args.pack_weights,
        tune_budget=args.tune_budget,
        tune_cache=args.tune_cache,
        up_layout=args.up_layout,
        down_layout=args.down_layout,
        layout=args.layout,
        profile=args.profile,
        plan_batch=args.plan_batch,
        link=args.link,
        heartbeat_s=args.timeout_s or HEARTBEAT_S,
        allow_extreme_weights=args.allow_extreme_weights,
    )


def open_engine(args: argparse.Namespace):
    """The ``LLM`` the options describe (use it as a context manager)."""
    from runtime.engine.llm import LLM

    print(
        f"loading {args.checkpoint} (spec {args.spec}, mode {args.mode}) ...",
        file=sys.stderr,
        flush=True,
    )
    return LLM(args.spec, args.checkpoint, engine_options(args))


def follow_rank0(args: argparse.Namespace) -> bool:
    """On a ``torchrun`` rank other than 0: open the engine and run rank 0's calls until
    it closes (rank 0 drives, prints and serves HTTP); True then. False elsewhere."""
    from runtime.dist.torchrun_group import torchrun_follower

    if not torchrun_follower():
        return False
    with open_engine(args) as llm:
        llm.follow()
    return True


def tuned_note(llm) -> str:
    """ " (tuned 8 shapes in 12.3 s: 8 timed, 0 from the cache)" for the start-up line;
    nothing where the products were not tuned."""
    report = llm.tuning()
    return f" ({report.describe()})" if report.shapes else ""
