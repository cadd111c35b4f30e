"""``deinfer run``: generate from a prompt with the engine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dsl.plan import MODES


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text (or token ids) with a decomposed checkpoint")
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text if the checkpoint has a tokenizer, else comma-separated token ids; "
        "repeat for a batch",
    )
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
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE[,LATENCY]",
        help="run the ranks in network namespaces behind an emulated link, e.g. 200mbit "
        "(tc units; needs root and iproute2)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds a rank may go silent (stopped, hung) before the run stops naming it "
        "(default 15)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from runtime.engine import LLM
    from runtime.launcher import HEARTBEAT_S, WorkerGroup
    from runtime.sequence import SamplingParams

    start = time.perf_counter()
    print(
        f"loading {args.checkpoint} (spec {args.spec}, mode {args.mode}) ...",
        file=sys.stderr,
        flush=True,
    )
    with LLM(
        args.spec,
        args.checkpoint,
        tp=args.tp,
        mode=args.mode,
        kv_cache=args.kv_cache,
        backend=args.backend,
        path=args.path,
        threads=args.threads,
        link=args.link,
        heartbeat_s=args.timeout_s or HEARTBEAT_S,
    ) as llm:
        print(
            f"loaded in {time.perf_counter() - start:.1f} s: tp {llm.spec.parallel.tp}, "
            f"{llm.describe_path()}",
            file=sys.stderr,
            flush=True,
        )
        prompts = [
            p if llm.tokenizer else [int(t) for t in p.split(",") if t.strip()] for p in args.prompt
        ]
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        outputs = llm.generate(prompts, params)
        if (
            llm.workers.world > 1
            and not isinstance(llm.workers, WorkerGroup)
            and torch.distributed.get_rank() != 0
        ):
            return 0  # under torchrun, rank 0 reports
        failed = 0
        for prompt, out in zip(prompts, outputs, strict=True):
            if out.finish_reason and out.finish_reason.startswith("error"):
                failed += 1
                reason = out.finish_reason.removeprefix("error: ")
                print(f"error: prompt {str(prompt)[:60]!r}: {reason}", file=sys.stderr)
                continue
            shown = out.text if out.text is not None else " ".join(map(str, out.token_ids))
            print(f"{prompt!r} -> {shown}")
            itl = sum(out.itl) / len(out.itl) * 1e3 if out.itl else 0.0
            print(
                f"  {len(out.token_ids)} tokens, finish {out.finish_reason}, "
                f"TTFT {out.ttft * 1e3:.1f} ms, mean ITL {itl:.1f} ms",
                file=sys.stderr,
            )
    return 2 if failed else 0
