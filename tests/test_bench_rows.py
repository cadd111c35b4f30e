"""`deinfer bench`'s ratios between rows (vs base, latent vs dense KV, vs tp 1) and its
lockstep mode, from canned and tiny-model runs (no timing assertions)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bench.measure import median_breakdown
from bench.report import markdown
from bench.runner import BenchConfig, run_bench, variants_of
from bench.variants import phases
from dsl import load_spec, with_tp
from tests.conftest import SPECS
from tests.test_bench import _tiny_bench


def test_ratio_to_base_is_also_taken_within_each_repetition():
    """A machine that slows down between repetitions moves every row alike: the ratio
    within each repetition stays put where the ratio of medians would not."""
    from bench.ratios import add_ratios

    def row(mode: str, rates: list[float]) -> dict:
        return {
            "mode": mode,
            "kv_cache": "dense",
            "tp": 2,
            "ratio": None,
            "batch": None,
            "max_seq_len": None,
            "throughput": [{"decode_tokens_per_s": r, "output_tokens_per_s": r} for r in rates],
        }

    results = {
        "config": {"num_requests": 8, "max_batch": 8},
        "machine": {},
        "variants": [row("base", [10.0, 20.0, 40.0]), row("deinfer", [11.0, 22.0, 44.0])],
    }
    add_ratios(results)
    deinfer = results["variants"][1]
    assert deinfer["decode_speedup_vs_base_per_rep"] == pytest.approx(
        {"min": 1.1, "median": 1.1, "max": 1.1}
    )
    assert deinfer["decode_speedup_vs_base"] == pytest.approx(22.0 / 20.0)
    assert results["variants"][0]["decode_speedup_vs_base_per_rep"]["max"] == 1.0


def test_latent_rows_get_their_step_time_over_the_dense_kv_engine():
    """Issue 10's latent aim is a step-time ratio: dense tok/s over latent tok/s of the
    same configuration, also within each repetition, and shown in the report."""
    from bench.ratios import add_ratios
    from bench.report import markdown

    def row(kv: str, ratio: float, rates: list[float]) -> dict:
        return {
            "mode": "deinfer",
            "kv_cache": kv,
            "tp": 1,
            "ratio": ratio,
            "batch": 8,
            "max_seq_len": None,
            "up_layout": "auto",
            "label": f"deinfer kv={kv} tp1 r{ratio:g} b8",
            "throughput": [{"decode_tokens_per_s": r, "output_tokens_per_s": r} for r in rates],
        }

    results = {
        "config": {"num_requests": 8, "max_batch": 8, "spec": "s", "prompt_len": 1},
        "machine": {"cpu": "c", "cores": 2, "gpu": None, "torch": "t", "triton": "t"},
        "variants": [
            row("dense", 0.0, [100.0, 50.0, 90.0]),
            row("latent", 0.0, [80.0, 40.0, 60.0]),
            row("dense", 0.4, [120.0, 120.0, 120.0]),
        ],
    }
    results["config"] |= {"output_len": 1, "reps": 3}
    add_ratios(results)
    dense, latent, other = results["variants"]
    assert latent["step_vs_dense_kv"] == pytest.approx(90.0 / 60.0)
    assert latent["step_vs_dense_kv_per_rep"] == pytest.approx(
        {"min": 1.25, "median": 1.25, "max": 1.5}
    )
    assert "step_vs_dense_kv" not in dense and "step_vs_dense_kv" not in other
    table = markdown(results)
    assert "step vs kv=dense" in table and "1.50x (1.25–1.50)" in table


def test_the_report_names_the_cpus_widest_vector_instructions():
    """Machines of one model name come with and without AVX-512 (the native kernels'
    speed differs), so the report says which."""
    from bench.variants import vector_isa

    assert vector_isa({"sse4_2", "avx", "avx2", "avx512f", "amx_tile"}) == "AVX-512 + AMX"
    assert vector_isa({"sse4_2", "avx", "avx2", "fma"}) == "AVX2"
    assert vector_isa({"neon"}) is None
    m = {"cpu": "AMD EPYC", "vector_isa": "AVX2", "cores": 2, "gpu": None}
    results = {
        "config": {"spec": "s", "prompt_len": 1, "output_len": 1, "reps": 3},
        "machine": m | {"torch": "t", "triton": "t"},
        "variants": [],
    }
    assert markdown(results).startswith("Machine: AMD EPYC (AVX2), 2 cores, GPU none;")


def test_lockstep_runs_take_turns_and_time_each_engine_over_its_own_steps(tmp_path, monkeypatch):
    """Engines in lockstep take one step each in turn; each one's rates come from its
    own steps, and the greedy tokens are what it makes alone."""
    from bench.measure import lockstep_runs, prompts_for
    from runtime.engine.llm import LLM
    from runtime.engine.sequence import SamplingParams
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec = with_tp(load_spec(SPECS / "tiny-llama.yaml"), 1)
    write_random_checkpoint(spec, tmp_path / "ck", 0)
    engines = [
        LLM(spec, tmp_path / "ck", mode="deinfer", kv_cache=kv) for kv in ("dense", "latent")
    ]
    cfg = BenchConfig(spec="unused", prompt_len=5, output_len=6, lockstep=True)
    prompts = prompts_for(cfg, 3, spec.model.vocab_size, cfg.seed)
    alone = [e.generate(prompts, SamplingParams(max_tokens=6)) for e in engines]
    steps, finished, original = [], [], LLM.step

    def recording_step(self):
        steps.append(engines.index(self))
        events = original(self)
        finished.extend((engines.index(self), s.id, list(s.output)) for s, _, _ in events)
        return events

    monkeypatch.setattr(LLM, "step", recording_step)
    runs = lockstep_runs(engines, cfg, spec.model.vocab_size, batch=3)
    # one prefill and five decode steps each, taken in turn: never two in a row
    assert steps == [0, 1] * 6
    for run in runs:
        assert set(run) == {
            "seconds",
            "requests_per_s",
            "output_tokens_per_s",
            "total_tokens_per_s",
            "decode_tokens_per_s",
        }
        assert run["decode_tokens_per_s"] > 0 and run["output_tokens_per_s"] > 0
    for i, outs in enumerate(alone):
        last = {sid: tokens for e, sid, tokens in finished if e == i}
        assert sorted(last.values()) == sorted(o.token_ids for o in outs)
    for e in engines:
        e.close()


def test_lockstep_bench_rows_and_its_limits():
    """In lockstep, engines in this process (tp 1) and with worker processes (tp 2) take
    turns, one tp degree at a time with ``phase_by_tp``; the rows get their ratios as in
    a plain run."""
    cfg = _tiny_bench(
        modes=("deinfer",),
        kv_caches=("dense", "latent"),
        tps=(1, 2),
        batches=(2,),
        lockstep=True,
        phase_by_tp=True,
    )
    labels = [[v.label for v in phase] for phase in phases(cfg)]
    assert labels == [
        ["deinfer kv=dense tp1 b2", "deinfer kv=latent tp1 b2", "hf tp1 b2"],
        ["deinfer kv=dense tp2 b2", "deinfer kv=latent tp2 b2"],
    ]
    assert [v.label for v in phases(replace(cfg, phase_by_tp=False))[0]] == [
        v.label for v in variants_of(cfg)
    ]
    results = run_bench(cfg)
    rows = {v["label"]: v for v in results["variants"]}
    assert set(rows) == {
        f"deinfer kv={kv} tp{tp} b2" for kv in ("dense", "latent") for tp in (1, 2)
    } | {"hf tp1 b2"}
    assert all(len(v["throughput"]) == 2 for v in rows.values())
    for tp in (1, 2):
        latent = rows[f"deinfer kv=latent tp{tp} b2"]
        dense = rows[f"deinfer kv=dense tp{tp} b2"]["decode_tokens_per_s"]["median"]
        assert latent["step_vs_dense_kv"] == pytest.approx(
            dense / latent["decode_tokens_per_s"]["median"]
        )
    assert "decode steps taken in turn" in markdown(results)


def test_tp1_thread_rows_run_at_their_own_thread_count_and_scaling_is_reported(monkeypatch):
    """``tp1_threads`` adds tp 1 rows with their own thread count (the same cores used by
    threads instead of ranks). In lockstep the engines of this process share its thread
    count, so each step of each runs at its row's; every row beside the tp 1 one gets its
    ratio to it."""
    import torch

    from runtime.engine.model_runner import ModelRunner

    cfg = _tiny_bench(
        modes=("dense",), tps=(1, 2), tp1_threads=(2,), batches=(2,), lockstep=True, hf=False
    )
    labels = [v.label for v in variants_of(cfg)]
    tp1 = "dense kv=dense tp1 b2"
    assert labels == [tp1, f"{tp1} threads=2", "dense kv=dense tp2 b2"]
    seen: dict[int, set[int]] = {}
    original = ModelRunner.step

    def recording_step(self, seqs, is_prefill):
        seen.setdefault(id(self), set()).add(torch.get_num_threads())
        return original(self, seqs, is_prefill)

    monkeypatch.setattr(ModelRunner, "step", recording_step)
    results = run_bench(cfg)
    assert sorted(map(sorted, seen.values())) == [[1], [2]]  # the two tp 1 engines here
    rows = {v["label"]: v for v in results["variants"]}
    assert [rows[label]["threads_per_rank"] for label in labels] == [1, 2, 1]
    one = rows[tp1]
    assert "decode_speedup_vs_tp1" not in one
    for label in labels[1:]:
        want = rows[label]["decode_tokens_per_s"]["median"] / one["decode_tokens_per_s"]["median"]
        assert rows[label]["decode_speedup_vs_tp1"] == pytest.approx(want)
        paired = rows[label]["decode_speedup_vs_tp1_per_rep"]
        assert paired["min"] <= paired["median"] <= paired["max"]
    table = markdown(results)
    assert "| vs tp 1 |" in table and "| dense kv=dense tp1 b2 threads=2 | 2 |" in table


def test_the_report_says_how_much_cpu_time_the_hypervisor_took():
    """On a shared VM the same run drifts with the time other guests take (steal): the
    bench measures it over its whole run from /proc/stat's counters."""
    from bench.variants import cpu_times, steal_fraction

    stat = "cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\nintr 1\n"
    before = cpu_times(stat)
    assert before == [100, 0, 50, 800, 10, 0, 0, 40, 0, 0]
    after = cpu_times("cpu  160 0 60 900 10 0 0 70 5 0\n")
    # 200 jiffies passed (guest time is inside user), 30 of them stolen
    assert steal_fraction(before, after) == pytest.approx(30 / 200)
    assert steal_fraction(before, before) is None  # no time passed
    assert steal_fraction(None, after) is None and cpu_times("intr 1\n") is None
    here = cpu_times()
    if Path("/proc/stat").is_file():  # Linux: the live counters parse
        assert here is not None and len(here) >= 8 and sum(here) > 0
    else:
        assert here is None
    m = {"cpu": "AMD EPYC", "cores": 2, "gpu": None, "torch": "t", "triton": "t"}
    results = {
        "config": {"spec": "s", "prompt_len": 1, "output_len": 1, "reps": 3},
        "machine": m | {"cpu_steal_fraction": 0.034},
        "variants": [],
    }
    assert re.search(r"steal\b.*\b3\.4 ?%", markdown(results))  # the measured share, named
    results["machine"] = m
    assert "steal" not in markdown(results)


def test_a_rank_alone_row_times_rank_0s_own_work_beside_the_real_tp2_row(monkeypatch):
    """``rank_alone`` adds each loopback tp 2 row again as its rank 0 alone in this
    process: the same shard (same streamed bytes, same up layout) at the row's threads,
    with no process group, set against tp 1 like the real row and named in the legend."""
    import torch
    import torch.distributed as dist

    from runtime.engine.model_runner import ModelRunner

    cfg = _tiny_bench(
        modes=("dense", "deinfer"), tps=(1, 2), rank_alone=True, batches=(2,), lockstep=True
    )
    labels = [v.label for v in variants_of(cfg) if v.mode != "hf"]
    assert labels == [
        "dense kv=dense tp1 b2",
        "deinfer kv=dense tp1 b2",
        "dense kv=dense tp2 b2",
        "dense kv=dense tp2 b2 rank alone",
        "deinfer kv=dense tp2 b2",
        "deinfer kv=dense tp2 b2 rank alone",
    ]
    assert not any(v.alone for v in variants_of(replace(cfg, links=("1gbit",), lockstep=False)))
    here: set[tuple[int, int, int]] = set()  # (tp, rank, threads) of steps in this process
    original = ModelRunner.step

    def recording_step(self, seqs, is_prefill):
        here.add((self.spec.parallel.tp, self.rank, torch.get_num_threads()))
        return original(self, seqs, is_prefill)

    monkeypatch.setattr(ModelRunner, "step", recording_step)
    results = run_bench(cfg)
    assert here == {(1, 0, 1), (2, 0, 1)} and not dist.is_initialized()
    rows = {v["label"]: v for v in results["variants"]}
    for mode in ("dense", "deinfer"):
        real, alone = rows[f"{mode} kv=dense tp2 b2"], rows[f"{mode} kv=dense tp2 b2 rank alone"]
        for same in ("streamed_weight_bytes_per_rank", "up_layout_used", "threads_per_rank"):
            assert alone[same] == real[same], (mode, same)
        one = rows[f"{mode} kv=dense tp1 b2"]["decode_tokens_per_s"]["median"]
        for row in (real, alone):  # each keeps its own rate
            want = row["decode_tokens_per_s"]["median"] / one
            assert row["decode_speedup_vs_tp1"] == pytest.approx(want)
    assert "*rank alone*: rank 0 of that tp degree alone" in markdown(results)


def test_a_rank_alone_engine_refuses_a_link(tmp_path):
    from bench.rank_alone import RankAloneLLM
    from dsl.errors import UserError

    spec = with_tp(load_spec(SPECS / "tiny-llama.yaml"), 2)
    with pytest.raises(UserError, match="a rank-alone engine has no link"):
        RankAloneLLM(spec, tmp_path / "ck", link="1gbit")


def test_a_rank_alone_engine_picks_the_up_layout_the_real_ranks_would(tmp_path):
    """``auto`` resolves as the real tp 2 ranks on this host resolve it: split where they
    would meet in shared memory, replicated when shared-memory collectives are off."""
    from bench.rank_alone import RankAloneLLM
    from dsl.plan import UP_REPLICATED, UP_SHARDED
    from runtime.dist.shm_collectives import supported
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec = with_tp(load_spec(SPECS / "tiny-llama.yaml"), 2)
    write_random_checkpoint(spec, tmp_path / "ck", 0)
    for shm, want in ((True, UP_SHARDED if supported() else UP_REPLICATED), (False, UP_REPLICATED)):
        llm = RankAloneLLM(spec, tmp_path / "ck", mode="deinfer", shm_collectives=shm)
        try:
            assert llm.workers.call("plan_up_layout") == [want], shm
        finally:
            llm.close()


def test_a_rows_breakdown_is_the_median_of_its_repetitions():
    """Every figure the median over repetitions (nested, lists element by element), the
    layers' own compute of each repetition kept beside it."""

    def run(compute, comm, ranks):
        return {
            "block_ms_per_step": {"communication": comm, "compute_and_overhead": compute},
            "block_compute_ms_per_step": max(ranks),
            "block_compute_ms_per_step_by_rank": ranks,
            "elements_per_token_per_block": {"all_reduce": 2048.0},
            "decode_steps": 15,
        }

    runs = [run(3.0, 9.0, [1.0, 2.0]), run(1.0, 7.0, [5.0, 1.5]), run(2.0, 8.0, [3.0, 4.0])]
    out = median_breakdown(runs)
    assert out["block_ms_per_step"] == {"communication": 8.0, "compute_and_overhead": 2.0}
    assert out["block_compute_ms_per_step"] == 4.0
    assert out["block_compute_ms_per_step_by_rank"] == [3.0, 2.0]
    assert out["elements_per_token_per_block"] == {"all_reduce": 2048.0}
    assert out["decode_steps"] == 15
    assert out["block_compute_ms_per_rep"] == [2.0, 5.0, 4.0]
    graphs = median_breakdown([{"block_compute_ms_per_step": None}])  # no eager layers
    assert graphs["block_compute_ms_per_step"] is None
