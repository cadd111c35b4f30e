"""Decode ITL of one job over two emulated machines (``deinfer launch``: torchrun
agents, rank 0 broadcasting each call) against the built-in launcher's ranks behind the
same link (``deinfer run --link``: one namespace per rank, the driver outside), tp 2,
interleaved repetitions. Needs root. Usage:

    python docs/bench/multi-host/launch_vs_group.py SPEC CHECKPOINT [--link 1gbit] [--reps 3]

SPEC/CHECKPOINT: any tp-2-capable model with a tokenizer-less or text prompt "1,2,3,4".
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

from runtime.dist.emulated_hosts import EmulatedHosts
from runtime.dist.emulated_link import LinkSpec

ITL = re.compile(r"mean ITL ([0-9.]+) ms")


def engine_args(spec: str, ckpt: str, tokens: int) -> list[str]:
    return ["run", "--spec", spec, "--checkpoint", ckpt, "--tp", "2", "--prompt", "1,2,3,4",
            "--max-tokens", str(tokens)]  # fmt: skip


def over_machines(spec: str, ckpt: str, link: LinkSpec, tokens: int, rep: int) -> float:
    with EmulatedHosts(2, link) as hosts:
        port = hosts.free_port(0)
        procs = []
        for h in range(2):
            launch = [
                sys.executable, "-m", "cli.main", "launch", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-endpoint", f"{hosts.address(0)}:{port}",
                "--local-addr", hosts.address(h), "--rdzv-id", f"itl-{rep}",
            ]  # fmt: skip
            command = hosts.command(h, [*launch, *engine_args(spec, ckpt, tokens)])
            procs.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        out = [p.communicate(timeout=600)[0] for p in procs]
    return float(ITL.search(out[0]).group(1))


def one_machine(spec: str, ckpt: str, link: LinkSpec, tokens: int) -> float:
    argv = [sys.executable, "-m", "cli.main", *engine_args(spec, ckpt, tokens)]
    argv += ["--link", f"{int(link.rate_bits_per_s)}bit"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    return float(ITL.search(done.stderr).group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("checkpoint")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    link = LinkSpec.parse(args.link)
    launch, group = [], []
    for rep in range(args.reps):
        launch.append(over_machines(args.spec, args.checkpoint, link, args.tokens, rep))
        group.append(one_machine(args.spec, args.checkpoint, link, args.tokens))
        print(f"rep {rep}: launch {launch[-1]:.2f} ms, built-in {group[-1]:.2f} ms", flush=True)
    a, b = statistics.median(launch), statistics.median(group)
    print(f"median mean ITL, tp 2, link {link.describe()}, {args.tokens} tokens: "
          f"deinfer launch over 2 emulated machines {a:.2f} ms, built-in launcher "
          f"{b:.2f} ms ({a / b:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
