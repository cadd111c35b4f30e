"""What a hostile request costs everyone else: ``deinfer serve`` streams to a client
(the victim) while another sends what once froze the server — a 50 MB body, 10,000 stop
strings of 100 characters, 4 MB of token ids, a 4 MB text prompt, 100,000-deep JSON. For
each, the server's answer and the longest gap between the victim's tokens while it was
being handled, beside the victim's gaps with nothing else going on.

    python -m bench.hostile --out docs/bench/hostile

By default the server runs a random checkpoint of ``specs/cpu-smoke.yaml`` at tp 1 with
a word-level tokenizer of its vocabulary (``--spec`` / ``--checkpoint``: another)."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.serve import ServerProcess
from bench.variants import machine
from dsl import load_spec, with_tp
from dsl.dump import dump_spec
from runtime.model.checkpoint import has_tokenizer

QUIET_S = 3.0  # the victim's gaps measured with nothing else going on


@dataclass
class Victim:
    """Streams requests one after another; records when each token arrived."""

    url: str
    model: str
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (previous, this)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        import httpx

        body = {"model": self.model, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        while not self.stop.is_set():
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: {"):
                        if last is not None:
                            self.gaps.append((last, now))
                        last = now
                    if self.stop.is_set():
                        break

    def worst_between(self, start: float, end: float) -> float:
        overlapping = [b - a for a, b in self.gaps if b >= start and a <= end]
        return max(overlapping, default=0.0)


def _raw(port: int, head: bytes, body: bytes) -> int:
    """Send a request on a raw socket (the body as far as the server takes it); its
    status."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        with contextlib.suppress(OSError):  # answered and closed before the body was sent
            sock.sendall(head + body)
        reply = sock.recv(4096)
    return int(reply.split(b" ", 2)[1]) if reply else 0


def attacks(model: str, vocab: int, text: bool) -> list[tuple[str, Callable[[int], int]]]:
    """(what, send(port) -> status) for each hostile request."""

    def post(payload: bytes) -> Callable[[int], int]:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode()
        return lambda port: _raw(port, head, payload)

    def doc(**fields: Any) -> bytes:
        return json.dumps({"model": model, **fields}).encode()

    ids = [i % vocab for i in range(700_000)]  # ~4 MB of JSON
    out = [
        ("50 MB text prompt", post(doc(prompt="a " * (25 << 20)))),
        ("10,000 stop strings of 100 characters", post(doc(prompt=[1], stop=["x" * 100] * 10**4))),
        ("4 MB of token ids", post(doc(prompt=ids[:600_000]))),
        ("100,000-deep JSON", post(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
    ]
    if text:
        out.append(("4 MB text prompt", post(doc(prompt=" ".join(["w1"] * 1_300_000)))))
    return out


def run(server: ServerProcess, model: str, vocab: int, text: bool, reps: int) -> dict[str, Any]:
    victim = Victim(server.url, model)
    thread = threading.Thread(target=victim.run, daemon=True)
    thread.start()
    time.sleep(1.0)  # warm
    quiet_start = time.perf_counter()
    time.sleep(QUIET_S)
    quiet = [b - a for a, b in victim.gaps if a >= quiet_start]
    runs: dict[str, list[tuple[int, float, float]]] = {}
    for _ in range(reps):  # each request once per repetition, in turn
        for what, send in attacks(model, vocab, text):
            start = time.perf_counter()
            status = send(server.port)
            end = time.perf_counter()
            time.sleep(0.3)  # the gap that ends after the answer counts too
            gap = victim.worst_between(start, end) * 1e3
            runs.setdefault(what, []).append((status, end - start, gap))
    victim.stop.set()
    rows = [
        {
            "request": what,
            "status": sorted({s for s, _, _ in r}),
            "answered_s": statistics.median(t for _, t, _ in r),
            "worst_gap_ms": {
                "median": statistics.median(g for _, _, g in r),
                "max": max(g for _, _, g in r),
            },
        }
        for what, r in runs.items()
    ]
    thread.join(timeout=120)
    return {
        "quiet_gap_ms": {
            "median": statistics.median(quiet) * 1e3,
            "max": max(quiet) * 1e3,
            "count": len(quiet),
        },
        "rows": rows,
    }


def _word_tokenizer(vocab: int, folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)


def markdown(result: dict[str, Any]) -> str:
    q = result["quiet_gap_ms"]
    lines = [
        f"# Hostile requests beside a stream ({result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores)",
        "",
        f"Victim stream alone: median gap {q['median']:.1f} ms, worst {q['max']:.1f} ms "
        f"({q['count']} gaps over {QUIET_S:.0f} s). Each request sent {result['reps']} "
        "times; its worst gap: median and max over those.",
        "",
        "| request | answer | answered in (median) | worst gap of the stream meanwhile |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        gap = r["worst_gap_ms"]
        lines.append(
            f"| {r['request']} | {', '.join(map(str, r['status']))} "
            f"| {r['answered_s'] * 1e3:.0f} ms | {gap['median']:.1f} ms (max {gap['max']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from runtime.tools.random_checkpoint import write_random_checkpoint

    p = argparse.ArgumentParser(prog="python -m bench.hostile")
    p.add_argument("--spec", type=Path, default=Path("specs/cpu-smoke.yaml"))
    p.add_argument("--checkpoint", type=Path, default=None, help="default: random factors")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    spec = with_tp(load_spec(args.spec), 1)
    with tempfile.TemporaryDirectory(prefix="deinfer-hostile-") as tmp:
        spec_path = Path(tmp) / f"{spec.name}.yaml"
        spec_path.write_text(dump_spec(spec))
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = write_random_checkpoint(spec, Path(tmp) / "checkpoint")
            _word_tokenizer(spec.model.vocab_size, ckpt)
        serve_args = ["--spec", str(spec_path), "--checkpoint", str(ckpt), "--tp", "1"]
        with ServerProcess(serve_args, Path(tmp) / "serve.log") as server:
            vocab = spec.model.vocab_size
            result = run(server, spec.name, vocab, has_tokenizer(ckpt), args.reps)
    result = {"machine": machine(), "spec": str(args.spec), "reps": args.reps, **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
