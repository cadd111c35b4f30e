"""Decode tok/s of a model at tp 1: bounded tuning (budget 16) against full per-shape
tuning (every shape timed), one process, the generates interleaved, batch 1 and 16, 5
repetitions, median. Both engines read one tuning cache ($DEINFER_CACHE_DIR, start it
empty), filled by the full tuning first: the bounded engine's representatives carry the
same timings, so what differs is the classes.

    DEINFER_CACHE_DIR=/tmp/cfull python docs/bench/startup/bounded_vs_full.py SPEC CKPT
"""

import json
import statistics
import sys
import time

from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams


def main(spec: str, checkpoint: str) -> dict:
    out: dict = {}
    engines = {}
    for name, budget in (("full", 100_000), ("bounded", 16)):
        start = time.perf_counter()
        engines[name] = LLM(spec, checkpoint, tp=1, tune_budget=budget, num_blocks=800)
        out[name] = {"load_s": time.perf_counter() - start, "tuning": vars(engines[name].tuning())}
    for batch in (1, 16):
        prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
        params = SamplingParams(max_tokens=48, stop_token_ids=())
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for engine in engines.values():  # warm-up
            engine.generate(prompts, params)
        for _ in range(5):
            for name, engine in engines.items():
                start = time.perf_counter()
                results = engine.generate(prompts, params)
                tokens = sum(len(r.token_ids) for r in results)
                rates[name].append(tokens / (time.perf_counter() - start))
        for name in engines:
            out[name][f"b{batch} tok/s"] = statistics.median(rates[name])
            out[name][f"b{batch} all"] = rates[name]
        ratio = out["bounded"][f"b{batch} tok/s"] / out["full"][f"b{batch} tok/s"]
        out[f"b{batch} bounded/full"] = ratio
    forms = {name: e.workers.call("gemm_forms")[0] for name, e in engines.items()}
    cells = [(shape, rows) for shape, table in forms["full"].items() for rows in table]
    out["cells differing (shape x rows)"] = sum(
        forms["full"][s][r] != forms["bounded"][s][r] for s, r in cells
    )
    out["cells"] = len(cells)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3]), indent=1))
