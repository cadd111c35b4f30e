"""Serving load: requests sent at Poisson arrival times, each streamed, timed per token
on receipt. Two transports run the same workload: HTTP (an OpenAI-compatible server,
ours or any other, through ``/v1/completions`` with SSE) and in-process (the server's
own ``EngineLoop``, no HTTP), so their difference is what HTTP, JSON and SSE cost."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsl.errors import UserError

Prompt = str | list[int]


@dataclass(frozen=True)
class Workload:
    prompts: tuple[Prompt, ...]
    output_lens: tuple[int, ...]

    @classmethod
    def seeded(cls, n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> Workload:
        rng = random.Random(seed)
        prompts = tuple([rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n))
        return cls(prompts, (output_len,) * n)

    @classmethod
    def from_jsonl(cls, path: Path, output_len: int) -> Workload:
        """One request per line: {"prompt": text or token ids, "max_tokens": n (optional)}."""
        prompts, lens = [], []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append(row["prompt"])
                lens.append(int(row.get("max_tokens", output_len)))
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(f"{path}:{i}: expected {{'prompt': ...}}, {exc}") from None
        if not prompts:
            raise UserError(f"{path}: no requests")
        return cls(tuple(prompts), tuple(lens))


@dataclass
class RequestTiming:
    start: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


Send = Callable[[Prompt, int], Awaitable[RequestTiming]]


async def run_load(send: Send, work: Workload, rate: float, seed: int) -> dict[str, Any]:
    """Send every request of ``work`` at Poisson times of ``rate`` per second (inf: all
    at once) and summarise what came back."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    for prompt, n in zip(work.prompts, work.output_lens, strict=True):
        tasks.append(asyncio.ensure_future(send(prompt, n)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    timings = await asyncio.gather(*tasks)
    return summarize(timings, time.perf_counter() - start, rate)


def _stats(values: list[float]) -> dict[str, float]:
    from bench.measure import summary

    return {k: v * 1e3 for k, v in summary(values).items()}


def summarize(timings: list[RequestTiming], duration: float, rate: float) -> dict[str, Any]:
    done = [t for t in timings if t.error is None and t.token_times]
    ttft = [t.token_times[0] - t.start for t in done]
    e2e = [t.token_times[-1] - t.start for t in done]
    tpot = [
        (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
        for t in done
        if len(t.token_times) > 1
    ]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    tokens = sum(len(t.token_times) for t in done)
    return {
        "request_rate": rate,
        "requests": len(timings),
        "completed": len(done),
        "errors": sorted({t.error for t in timings if t.error}),
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "output_tokens_per_s": tokens / duration,
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats(e2e),
    }


def http_sender(client: Any, url: str, model: str) -> Send:
    """Stream one completion from an OpenAI-compatible server (``client``: httpx.AsyncClient);
    greedy, EOS ignored so every request makes exactly its tokens. A chunk carrying
    ``token_ids`` (our server, vLLM) counts that many tokens; otherwise one per chunk."""

    async def send(prompt: Prompt, max_tokens: int) -> RequestTiming:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        timing = RequestTiming(time.perf_counter())
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    timing.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return timing
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        timing.error = chunk["error"]["message"]
                        return timing
                    choice = chunk["choices"][0] if chunk.get("choices") else {}
                    count = len(choice.get("token_ids", ())) or (
                        1 if choice.get("finish_reason") is None else 0
                    )
                    timing.token_times += [now] * count
        except Exception as exc:  # a refused connection, a reset: the request failed
            timing.error = f"{type(exc).__name__}: {exc}"
        return timing

    return send


def inprocess_sender(engine: Any) -> Send:
    """The same request through the server's ``EngineLoop`` directly (token id prompts)."""
    from runtime.engine.sequence import SamplingParams
    from runtime.serve.engine_loop import Finished

    async def send(prompt: Prompt, max_tokens: int) -> RequestTiming:
        ids = list(engine.llm.tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
        timing = RequestTiming(time.perf_counter())
        handle = engine.submit(ids, SamplingParams(max_tokens=max_tokens))
        while True:
            event = await handle.events.get()
            if isinstance(event, Finished):
                engine.release(handle)
                if event.reason.startswith("error"):
                    timing.error = event.reason
                return timing
            timing.token_times.append(time.perf_counter())

    return send


async def fetch_model(client: Any, url: str) -> str:
    try:
        resp = await client.get(f"{url}/v1/models")
        return resp.json()["data"][0]["id"]
    except Exception as exc:
        raise UserError(f"{url}/v1/models did not answer with a model: {exc}") from None
