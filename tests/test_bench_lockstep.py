"""Engines measured in lockstep (``bench.measure``): their decode steps, and their
per-block breakdowns, taken in turn, each engine timed over its own; fake engines stand
in for the real ones (``tests/test_bench_rows.py`` runs real ones)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from bench.config import preset


class _FakeEngine:
    """What ``lockstep_runs`` uses of an engine: one token per request and step."""

    def __init__(self, tp: int, log: list[str], name: str) -> None:
        self.spec = SimpleNamespace(parallel=SimpleNamespace(tp=tp))
        self.workers = SimpleNamespace(call=lambda *args: None)
        self.scheduler = SimpleNamespace(has_work=lambda: self.left > 0)
        self.log, self.name, self.left, self.seqs = log, name, 0, []

    def add_request(self, prompt, params):
        self.seqs.append(SimpleNamespace(id=len(self.seqs)))
        self.left = params.max_tokens

    def step(self):
        self.log.append(self.name)
        self.left -= 1
        return [(s, 0, 0.0) for s in self.seqs]


def test_lockstep_waits_out_spinning_threads_before_another_process_steps(monkeypatch):
    """A 2-thread step in this process is followed by the pause only when some engine's
    ranks run elsewhere (their cores are the ones the spinning threads would take)."""
    from bench import measure

    cfg = replace(preset("cpu-smoke"), output_len=2, num_requests=1)
    round_with_ranks = ["t1", "t2", "pause", "ranks"]
    for tps, threads, expected in (
        ((1, 1, 2), [1, 2, None], round_with_ranks * 2),
        ((1, 1), [1, 2], ["t1", "t2"] * 2),  # the spinning threads are the next engine's own
    ):
        log: list[str] = []
        monkeypatch.setattr(measure.time, "sleep", lambda s, log=log: log.append("pause"))
        names = [f"t{t}" if t else "ranks" for t in threads]
        engines = [_FakeEngine(tp, log, n) for tp, n in zip(tps, names, strict=True)]
        runs = measure.lockstep_runs(engines, cfg, vocab=8, threads=threads)
        assert len(runs) == len(engines)
        assert log == expected


class _FakeTimedEngine(_FakeEngine):
    """``_FakeEngine`` whose ranks time collectives: each step adds ``comm_s`` to one
    all-reduce of 8 elements per token and ``own_s`` to its layers' own time."""

    def __init__(self, log: list[str], name: str, comm_s: float, own_s: float) -> None:
        super().__init__(2, log, name)
        self.calls: list[tuple] = []
        self.comm_s, self.own_s, self.stats = comm_s, own_s, self._empty()
        self.workers = SimpleNamespace(call=self._call)

    @staticmethod
    def _empty() -> dict:
        return {"all_reduce": [0, 0, 0.0], "step:blocks": [0, 0, 0.0]}

    def _call(self, method, *args):
        self.calls.append((method, *args))
        if method == "take_comm_stats":
            stats, self.stats = self.stats, self._empty()
            return [stats, stats]
        return None

    def step(self):
        out = super().step()
        if out:
            self.stats["all_reduce"][0] += len(out)
            self.stats["all_reduce"][1] += 8 * len(out)
            self.stats["all_reduce"][2] += self.comm_s
            self.stats["step:blocks"][2] += self.own_s
        return out


def test_lockstep_breakdowns_take_turns_and_read_each_engines_own_stats():
    """Two engines' breakdowns step in turn; each reads its own ranks' collectives and
    layers' own time (after its prefill), timed only while the breakdown runs."""
    from bench import measure

    cfg = replace(preset("cpu-smoke"), output_len=4, num_requests=2, max_batch=2)
    log: list[str] = []
    engines = [
        _FakeTimedEngine(log, "a", comm_s=0.001, own_s=0.004),
        _FakeTimedEngine(log, "b", comm_s=0.003, own_s=0.002),
    ]
    outs = measure.lockstep_breakdowns(engines, [2, 2], cfg, vocab=8)
    steps = (
        min(cfg.breakdown_steps + 1, cfg.output_len) - 1
    )  # each request's tokens, less the prefill's
    assert log == ["a", "b"] + ["a", "b"] * steps  # each prefill, then decode steps in turn
    for engine, out, comm_s, own_s in zip(
        engines, outs, (0.001, 0.003), (0.004, 0.002), strict=True
    ):
        assert out["decode_steps"] == steps and out["decode_tokens"] == 2 * steps
        assert out["block_ms_per_step"]["communication"] == pytest.approx(comm_s * 1e3 / 2)
        assert out["block_compute_ms_per_step"] == pytest.approx(own_s * 1e3 / 2)
        assert out["elements_per_token_per_block"] == {"all_reduce": 4.0}
        methods = [c[0] for c in engine.calls]
        assert methods[0] == "set_comm_stats" and engine.calls[0][1] == "timed"
        assert engine.calls[-1] == ("set_comm_stats", "off")
