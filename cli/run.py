"""``deinfer run``: generate from a prompt with the engine."""

from __future__ import annotations

import argparse
import sys
import time

from cli.engine_options import add_engine_arguments, follow_rank0, open_engine, tuned_note
from dsl.errors import UserError


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text (or token ids) with a decomposed checkpoint")
    add_engine_arguments(p)
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text if the checkpoint has a tokenizer, else comma-separated token ids; "
        "repeat for a batch",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from runtime.engine.sequence import SamplingParams

    if follow_rank0(args):
        return 0
    start = time.perf_counter()
    with open_engine(args) as llm:
        print(
            f"loaded in {time.perf_counter() - start:.1f} s{tuned_note(llm)}: tp "
            f"{llm.spec.parallel.tp}, {llm.describe_path()}",
            file=sys.stderr,
            flush=True,
        )
        prompts = [p if llm.tokenizer else _token_ids(p) for p in args.prompt]
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        outputs = llm.generate(prompts, params)
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


def _token_ids(prompt: str) -> list[int]:
    try:
        return [int(t) for t in prompt.split(",") if t.strip()]
    except ValueError:
        raise UserError(
            f"--prompt {prompt[:40]!r}: this checkpoint has no tokenizer, so a prompt is "
            "comma-separated token ids"
        ) from None
