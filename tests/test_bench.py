"""`deinfer bench` on a tiny model: the structure of its outputs and that the measured
communication equals the plan (no timing assertions)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from bench.link_planner import CostModelPlanner
from bench.link_report import link_markdown, link_plot
from bench.report import markdown, plots
from bench.rows import threads_per_rank
from bench.runner import (
    PRESETS,
    BenchConfig,
    preset,
    run_bench,
    variants_of,
)
from cli.main import main as cli
from dsl import load_spec
from dsl.errors import UserError
from runtime.dist.emulated_link import namespaces
from runtime.engine.config import default_threads
from tests.conftest import REPO, SPECS
from tests.test_emulated_link import needs_netns
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
        # a breakdown per repetition, the row's figures their medians
        assert len(v["breakdown"]["block_compute_ms_per_rep"]) == 2
        measured = v["breakdown"]["elements_per_token_per_block"]
        planned = v["planned_elements_per_token_per_block"]
        assert measured == pytest.approx(planned, rel=1e-12), v["label"]
        base = next(b for b in results["variants"] if b["mode"] == "base" and b["tp"] == v["tp"])
        want = d["median"] / base["decode_tokens_per_s"]["median"]
        assert v["decode_speedup_vs_base"] == pytest.approx(want)
    table = markdown(results)
    assert table.count("(= plan)") == len(results["variants"])
    _check_startup(results, table)
    files = plots(results, tmp_path)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files)
    assert json.loads(json.dumps(results))["config"]["tps"] == [1, 2]  # JSON as written


def _check_startup(results, table: str) -> None:
    """Each engine's start-up is timed, its tuning counted, and the report lists both."""
    for v in results["variants"]:
        assert v["start_seconds"] > 0
        tuning = v["tuning"]
        assert tuning is None or tuning["timed"] + tuning["cached"] == tuning["classes"]
    startup = next(line for line in table.splitlines() if line.startswith("*Start-up*"))
    assert all(f"{v['label']} " in startup for v in results["variants"])


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
    # deinfer's optimized layout merges a matrix only where that streams fewer bytes or
    # saves time, so it never streams more than the products
    deinfer = rows["deinfer kv=dense tp1 b1 len16"]
    assert deinfer["streamed_weight_bytes_per_rank"] <= hf["streamed_weight_bytes_per_rank"]
    assert dense["decode_speedup_vs_dense"] == 1.0 and deinfer["decode_speedup_vs_dense"] > 0
    assert dense["path"] == "dynamic"
    table = markdown(results)
    assert "| hf tp1 b2 |" in table and "GB/s" in table


def test_bench_rows_record_the_reordered_weights_and_can_go_without():
    """A row records its rank's reordered weights, beside the weights or released in
    their place, there exactly when a tuned form uses them; ``pack_weights=False``
    starts the engines without any."""
    for packing in (True, False):
        results = run_bench(_tiny_bench(modes=("dense",), hf=False, reps=1, pack_weights=packing))
        (row,) = results["variants"]
        forms = {f for table in row["gemm_forms"].values() for f in table.values()}
        reordered = row["packed_weight_bytes_per_rank"] + row["released_weight_bytes_per_rank"]
        assert (reordered > 0) == bool(forms & {"packed", "panel"})
        if not packing:
            assert reordered == 0 and not forms & {"packed", "panel"}


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
    # transformers runs on the cores of the tp 2 engine rows (one thread per rank)
    (hf,) = [v for v in variants_of(table5) if v.mode == "hf"]
    assert threads_per_rank(table5, hf) == min(2, default_threads(1))
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
    lengths = ["--prompt-len", str(tiny.prompt_len + 1), "--output-len", str(tiny.output_len + 1)]
    assert cli(["bench", "--preset", "test-tiny", *lengths, "--out", str(tmp_path)]) == 0
    for name in ("results.json", "results.md", "throughput_vs_tp.png", "breakdown.png"):
        assert (tmp_path / name).is_file()
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    wanted = (tiny.prompt_len + 1, tiny.output_len + 1)
    assert (config["prompt_len"], config["output_len"]) == wanted
    with pytest.raises(UserError, match="--output-len"):
        BenchConfig(spec=tiny.spec, output_len=1)


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
        lockstep=True,  # the rows of each link step in turn, their breakdowns too
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
        block = v["breakdown"]["block_ms_per_step"]
        assert block["communication"] > 0
        # the layers' own work: within the step's time per block, never negative
        own = v["breakdown"]["block_compute_ms_per_step"]
        assert 0 < own < block["communication"] + block["compute_and_overhead"]
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


@needs_netns
def test_bench_rows_across_emulated_hosts_say_so(tmp_path):
    """--hosts 2: the linked rows of tp 2 and 4 run on two emulated machines, their
    labels say hosts=2; tp 1 rows stay as they are."""
    cfg = BenchConfig(
        spec=str(SPECS / "tiny-llama.yaml"),
        tps=(1, 4),
        modes=("deinfer", "dense"),
        num_requests=2,
        prompt_len=4,
        output_len=3,
        max_batch=2,
        breakdown_steps=2,
        reps=1,
        serving=False,
        links=("300mbit",),
        hosts=2,
    )
    results = run_bench(cfg, None)
    assert {v["label"] for v in results["variants"]} == {
        "deinfer kv=dense tp1",
        "dense kv=dense tp1",
        "deinfer kv=dense tp4 link=300mbit hosts=2",
        "dense kv=dense tp4 link=300mbit hosts=2",
    }
    for v in results["variants"]:
        assert v["throughput"][0]["decode_tokens_per_s"] > 0
    assert [n for n in namespaces() if n.startswith(f"deinfer-{os.getpid()}-")] == []
    with pytest.raises(UserError, match="--hosts 2: emulated machines need --link"):
        BenchConfig(spec="s", hosts=2)


def _parsed_bench(*argv: str):
    import argparse

    from cli.bench import _bench_config, add_bench

    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return _bench_config(args, preset(args.preset))


def test_a_link_keeps_a_presets_lockstep_and_an_asked_for_one():
    """Rows behind one link step together as rows on loopback do."""
    assert _parsed_bench("--preset", "vs-dense-cpu").lockstep
    behind = _parsed_bench("--preset", "vs-dense-cpu", "--link", "ratio:0.373")
    assert behind.lockstep and behind.links == ("ratio:0.373",)
    asked = _parsed_bench("--preset", "cpu-smoke", "--lockstep", "--link", "ratio:0.373")
    assert asked.lockstep and asked.links == ("ratio:0.373",)
