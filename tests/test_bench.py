"""`deinfer bench` on a tiny model: the structure of its outputs and that the measured
communication equals the plan (no timing assertions)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from codegen.cli.main import main as cli
from dsl import load_spec
from runtime.dist.emulated_link import namespaces
from runtime.tools.bench.link_report import link_markdown, link_plot
from runtime.tools.bench.report import markdown, plots
from runtime.tools.bench.runner import PRESETS, BenchConfig, preset, run_bench, variants_of
from tests.conftest import REPO, SPECS
from tests.test_emulated_link import needs_netns
from tune.link_planner import CostModelPlanner
from tune.profiles import load_profile


def test_bench_structure_and_measured_comm_equals_plan(tmp_path):
    cfg = BenchConfig(
        spec=str(SPECS / "tiny-llama.yaml"),
        tps=(1, 2),
        kv_caches=("dense", "latent"),
        num_requests=3,
        prompt_len=5,
        output_len=4,
        max_batch=4,
        serving_requests=3,
        breakdown_steps=2,
        reps=2,
        up_layouts=("auto", "replicated"),
    )
    messages = []
    results = run_bench(cfg, messages.append)
    assert messages, "no progress reported"
    assert set(results) == {"config", "machine", "variants"}
    assert {"cpu", "cores", "torch", "triton", "gpu"} <= set(results["machine"])
    labels = {v["label"] for v in results["variants"]}
    assert labels == {
        f"{m} kv={kv} tp{tp}"
        for tp in (1, 2)
        for m, kv in (
            ("deinfer", "dense"),
            ("deinfer", "latent"),
            ("deinfer", "dense up=replicated"),
            ("deinfer", "latent up=replicated"),
            ("base", "dense"),
            ("dense", "dense"),
        )
    }
    _check_up_layouts(results)
    for v in results["variants"]:
        assert len(v["throughput"]) == 2 and len(v["serving"]) == 2
        for key in (
            "requests_per_s",
            "output_tokens_per_s",
            "total_tokens_per_s",
            "decode_tokens_per_s",
        ):
            assert v["throughput"][0][key] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(v["serving"][0][key]) == {"mean", "median", "p99"}
        d = v["decode_tokens_per_s"]
        assert d["min"] <= d["median"] <= d["max"]
        measured = v["breakdown"]["elements_per_token_per_block"]
        planned = v["planned_elements_per_token_per_block"]
        assert measured == pytest.approx(planned, rel=1e-12), v["label"]
        base = next(b for b in results["variants"] if b["mode"] == "base" and b["tp"] == v["tp"])
        want = d["median"] / base["decode_tokens_per_s"]["median"]
        assert v["decode_speedup_vs_base"] == pytest.approx(want)
    table = markdown(results)
    assert table.count("(= plan)") == len(results["variants"])
    files = plots(results, tmp_path)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files)
    assert json.loads(json.dumps(results))["config"]["tps"] == [1, 2]  # JSON as written


def _check_up_layouts(results) -> None:
    """auto splits the o/down up factors where the ranks share memory (tp 2 here); the
    table says so beside the label."""
    deinfer = [v for v in results["variants"] if v["mode"] == "deinfer"]
    used = {(v["label"], v["up_layout_used"]) for v in deinfer}
    assert ("deinfer kv=dense tp2", "sharded") in used
    assert ("deinfer kv=dense up=replicated tp2", "replicated") in used
    assert ("deinfer kv=dense tp1", "replicated") in used
    assert "| deinfer kv=dense tp2 (up=sharded) |" in markdown(results)


def _tiny_bench(**fields) -> BenchConfig:
    """A quick bench of tiny-llama (tp 1 unless told), transformers beside it, throughput
    only."""
    quick = {
        "spec": str(SPECS / "tiny-llama.yaml"),
        "tps": (1,),
        "prompt_len": 4,
        "output_len": 4,
        "hf": True,
        "threads": 1,
        "serving": False,
        "breakdown": False,
        "reps": 2,
    }
    return BenchConfig(**(quick | fields))


def test_bench_against_transformers_and_the_floor(tmp_path):
    """The hf row runs transformers on the same weights; every row is set against it and
    against the weight-streaming floor, at each batch and max_seq_len."""
    cfg = _tiny_bench(modes=("dense", "deinfer"), batches=(1, 2), max_seq_lens=(16, 64))
    results = run_bench(cfg)
    rows = {v["label"]: v for v in results["variants"]}
    assert set(rows) == {
        f"{m} kv=dense tp1 b{b} len{n}"
        for m in ("dense", "deinfer")
        for b in (1, 2)
        for n in (16, 64)
    } | {"hf tp1 b1", "hf tp1 b2"}
    bandwidth = results["machine"]["memory_bandwidth_bytes_per_s"]
    assert bandwidth > 0
    for v in rows.values():
        assert v["threads_per_rank"] == 1 and len(v["throughput"]) == 2
        hf = rows[f"hf tp1 b{v['batch']}"]["decode_tokens_per_s"]["median"]
        median = v["decode_tokens_per_s"]["median"]
        assert v["decode_speedup_vs_hf"] == pytest.approx(median / hf)
        floor = v["batch"] * bandwidth / v["streamed_weight_bytes_per_rank"]
        assert v["fraction_of_floor"] == pytest.approx(median / floor)
    # Dense mode at tp 1 streams exactly the weights transformers holds (the products).
    dense, hf = rows["dense kv=dense tp1 b1 len16"], rows["hf tp1 b1"]
    assert dense["streamed_weight_bytes_per_rank"] == hf["streamed_weight_bytes_per_rank"]
    assert (
        rows["deinfer kv=dense tp1 b1 len16"]["streamed_weight_bytes_per_rank"]
        != (hf["streamed_weight_bytes_per_rank"])
    )
    assert dense["path"] == "dynamic"
    table = markdown(results)
    assert "| hf tp1 b2 |" in table and "GB/s" in table


def test_bench_rows_record_the_reordered_weights_and_can_go_without():
    """A row records its rank's reordered weight copies, there exactly when a tuned form
    uses them; ``pack_weights=False`` starts the engines without any."""
    for packing in (True, False):
        results = run_bench(_tiny_bench(modes=("dense",), hf=False, reps=1, pack_weights=packing))
        (row,) = results["variants"]
        forms = {f for table in row["gemm_forms"].values() for f in table.values()}
        assert (row["packed_weight_bytes_per_rank"] > 0) == ("packed" in forms)
        if not packing:
            assert row["packed_weight_bytes_per_rank"] == 0 and "packed" not in forms


# The paper's settings (requests, prompt tokens, max tokens) and the scale of each preset.
PAPER_LOADS = {"paper-high-load-cpu": (512, 32, 160, 32), "paper-mild-load-cpu": (64, 64, 512, 16)}


def test_presets_scale_the_paper_settings_and_cli_writes_outputs(tmp_path, monkeypatch):
    for name, (requests, prompt, max_len, scale) in PAPER_LOADS.items():
        cfg = preset(name)
        assert cfg.prompt_len * 4 == prompt and (cfg.prompt_len + cfg.output_len) * 4 == max_len
        assert cfg.num_requests * scale == requests and cfg.max_batch == cfg.num_requests
    serving = preset("paper-serving-cpu")
    assert (serving.serving_requests, serving.prompt_len, serving.output_len) == (8, 8, 32)
    table5 = preset("paper-table5-cpu")
    assert "ratio:5.18" in table5.links and "ratio:0.373" in table5.links  # 12.182 / 2.352
    for name in PRESETS:  # every preset names a shipped spec and builds its rows
        cfg = preset(name)
        load_spec(REPO / cfg.spec)
        assert variants_of(cfg)
    tiny = replace(
        BenchConfig(spec=str(SPECS / "tiny-opt.yaml")),
        tps=(2,),
        modes=("deinfer",),
        num_requests=2,
        prompt_len=3,
        output_len=3,
        max_batch=2,
        serving_requests=2,
        breakdown_steps=1,
        reps=1,
    )
    monkeypatch.setitem(
        PRESETS,
        "test-tiny",
        {
            k: getattr(tiny, k)
            for k in (
                "spec",
                "tps",
                "modes",
                "num_requests",
                "prompt_len",
                "output_len",
                "max_batch",
                "serving_requests",
                "breakdown_steps",
                "reps",
            )
        },
    )
    assert cli(["bench", "--preset", "test-tiny", "--out", str(tmp_path)]) == 0
    for name in ("results.json", "results.md", "throughput_vs_tp.png", "breakdown.png"):
        assert (tmp_path / name).is_file()


@needs_netns
def test_bench_behind_emulated_links_with_the_cost_model(tmp_path):
    """Rows per link, each link measured, the rates resolved from a comm/compute ratio,
    every row predicted, the link table and the speed-up plot written; the namespaces
    gone afterwards."""
    cfg = BenchConfig(
        spec=str(SPECS / "tiny-llama.yaml"),
        tps=(2,),
        num_requests=2,
        prompt_len=4,
        output_len=3,
        max_batch=2,
        breakdown_steps=2,
        reps=1,
        serving=False,
        overlap=False,
        links=("ratio:0.2", "300mbit"),
    )
    planner = CostModelPlanner(profile=load_profile("a800-pcie"))
    results = run_bench(cfg, None, planner)
    assert set(results["links"]) == {"ratio:0.2", "300mbit"}
    for link in results["links"].values():
        assert link["probe"]["bytes_per_s"] > 0
    assert results["links"]["300mbit"]["rate"] == "300000000bit"
    assert results["planner"]["links"]["ratio:0.2"]["comm_over_compute"] == 0.2
    assert {v["label"] for v in results["variants"]} == {
        f"{m} kv=dense tp2 link={link}"
        for m in ("deinfer", "base", "dense")
        for link in ("ratio:0.2", "300mbit")
    }
    for v in results["variants"]:
        assert set(v["predicted"]) == {"compute_ms", "comm_ms", "total_ms"}
        assert v["predicted"]["comm_ms"] > 0
        assert v["breakdown"]["block_ms_per_step"]["communication"] > 0
        base = next(
            b for b in results["variants"] if b["mode"] == "base" and b["link"] == v["link"]
        )
        assert v["decode_speedup_vs_base"] == pytest.approx(
            v["decode_tokens_per_s"]["median"] / base["decode_tokens_per_s"]["median"]
        )
    table = link_markdown(results)
    assert table.count("| ratio:0.2 |") == 3 and table.count("| 300mbit |") == 3
    assert link_plot(results, tmp_path).is_file()
    assert [n for n in namespaces() if n.startswith(f"deinfer-{os.getpid()}-")] == []


def test_ratio_to_base_is_also_taken_within_each_repetition():
    """A machine that slows down between repetitions moves every row alike: the ratio
    within each repetition stays put where the ratio of medians would not."""
    from runtime.tools.bench.ratios import add_ratios

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
    from runtime.tools.bench.ratios import add_ratios
    from runtime.tools.bench.report import markdown

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


def test_lockstep_runs_take_turns_and_time_each_engine_over_its_own_steps(tmp_path, monkeypatch):
    """Engines in lockstep take one step each in turn; each one's rates come from its
    own steps, and the greedy tokens are what it makes alone."""
    from runtime.engine.llm import LLM
    from runtime.engine.sequence import SamplingParams
    from runtime.tools.bench.measure import lockstep_runs, prompts_for
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec = load_spec(SPECS / "tiny-llama.yaml").with_tp(1)
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
    turns; the rows get their ratios as in a plain run."""
    cfg = _tiny_bench(
        modes=("deinfer",), kv_caches=("dense", "latent"), tps=(1, 2), batches=(2,), lockstep=True
    )
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
    with pytest.raises(ValueError, match="--lockstep cannot be combined with --link"):
        BenchConfig(spec="s", links=("100mbit",), lockstep=True)


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
