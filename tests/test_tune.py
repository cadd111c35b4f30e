"""Autotuning on the CPU: search space, tuner selection with a fake timer, the store
(round trip, nearest bucket, normalised names, bad files) and its use by deinfer-gen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from codegen.generate import generate, write_atomically
from dsl import parse_spec
from runtime.kernels import nearest_bucket, pick_config
from tests.conftest import REPO, SPECS
from tune.space import search_space, shared_memory_bytes, shared_memory_limit
from tune.store import (
    DEFAULT_CONFIGS,
    TunedFileWarning,
    choose,
    config_path,
    normalise_device_name,
    read_table,
    versions,
    write_table,
)
from tune.tuner import TuneJob, jobs_from_manifest, tune

META = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize(
    "raw,want",
    [
        ("NVIDIA H200", "NVIDIA_H200"),
        ("NVIDIA H200 NVL", "NVIDIA_H200"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA_H100"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA_A100"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA_A100"),
        ("NVIDIA RTX A6000", "NVIDIA_RTX_A6000"),
    ],
)
def test_device_names_fold_board_variants(raw, want):
    assert normalise_device_name(raw) == want


def test_nearest_bucket_prefers_larger_on_ties():
    assert nearest_bucket([1, 16, 64], 8) == 1
    assert nearest_bucket([1, 16, 64], 9) == 16
    assert nearest_bucket([4, 8], 6) == 8  # tie -> larger
    assert nearest_bucket([1, 256], 3000) == 256
    assert pick_config({1: {"a": 1}, 64: {"a": 2}}, 40) == {"a": 2}


@pytest.mark.parametrize("n,k,rows", [(9, 64, 1), (4916, 8192, 256), (128, 614, 16), (30, 17, 3)])
def test_search_space_is_pruned_by_shape_and_shared_memory(n, k, rows):
    for device in ("NVIDIA H200", "NVIDIA RTX A6000", None):
        space = search_space(n, k, rows, device)
        assert space and len({tuple(c.values()) for c in space}) == len(space)
        for cfg in space:
            assert cfg["BLOCK_N"] <= max(16, 1 << (n - 1).bit_length())
            assert cfg["BLOCK_K"] <= max(16, 1 << (k - 1).bit_length())
            assert cfg["BLOCK_M"] <= max(16, 1 << (rows - 1).bit_length())
            assert shared_memory_bytes(cfg, 2) <= shared_memory_limit(device)
    assert len(search_space(4096, 4096, 256, "NVIDIA H200")) > len(
        search_space(4096, 4096, 256, "NVIDIA RTX A6000")
    )


def test_store_round_trip_and_selection(tmp_path):
    path = config_path("NVIDIA H200 NVL", "gemm_fixed", "k64_n9", tmp_path)
    assert path == tmp_path / "NVIDIA_H200" / "gemm_fixed,k64_n9.json"
    table = {1: META, 64: {**META, "BLOCK_M": 64}}
    write_table(path, table, {"date": "2026-11-29"})
    assert read_table(path) == table
    choice = choose("gemm_fixed", "k64_n9", 9, 64, "NVIDIA H200", (1, 2, 48, 512), tmp_path)
    assert choice.source.startswith("tuned: NVIDIA_H200/")
    assert choice.configs[2]["BLOCK_M"] == 32 and choice.configs[48]["BLOCK_M"] == 64
    assert choice.configs[512]["BLOCK_N"] == 16  # clamped to the padded N


def test_missing_corrupt_and_foreign_files_give_defaults(tmp_path):
    missing = choose("gemm_fixed", "k64_n9", 9, 64, "NVIDIA H200", (1,), tmp_path)
    assert missing.source.startswith("default (no tuned file")
    assert set(missing.configs) == set(DEFAULT_CONFIGS)
    path = config_path("NVIDIA H200", "gemm_fixed", "k64_n9", tmp_path)
    path.parent.mkdir(parents=True)
    for content in (
        "{not json",
        json.dumps({"configs": {"1": {"BLOCK_M": 3}}, **versions()}),
        json.dumps({"configs": {"1": META}, "triton": "0.0.1", "torch": "1.0"}),
        json.dumps([1, 2]),
    ):
        path.write_text(content)
        with pytest.warns(TunedFileWarning):
            choice = choose("gemm_fixed", "k64_n9", 9, 64, "NVIDIA H200", (1,), tmp_path)
        assert choice.source.startswith("default (unusable tuned file")
        assert set(choice.configs) == set(DEFAULT_CONFIGS)


def test_tuner_keeps_the_fastest_skips_failures_and_stops_at_budget(tmp_path):
    job = TuneJob("gemm_fixed", "k64_n9", "gemm_fixed.py", 9, 64)

    def timer(module, job, rows, meta):
        if meta["num_warps"] == 8:
            raise RuntimeError("out of resources")
        return meta["BLOCK_K"] / 10 + meta["num_stages"] + rows / 1000

    results = tune(
        [job], {job.file: None}, [1, 16], "NVIDIA H200", timer, budget_s=60, root=tmp_path
    )
    best = results[job][16]
    assert best["num_warps"] == 4 and best["num_stages"] == 2 and best["BLOCK_K"] == 32
    assert read_table(job.path("NVIDIA H200", tmp_path)) == results[job]
    empty = tune([job], {job.file: None}, [1], "NVIDIA H100", timer, budget_s=-1, root=tmp_path)
    assert empty == {} and not job.path("NVIDIA H100", tmp_path).exists()


def test_gen_bakes_tuned_configs_and_says_so(tmp_path):
    text = (SPECS / "tiny-llama.yaml").read_text()
    folder = tmp_path / "gen"
    write_atomically(generate(parse_spec(text, "tiny-llama")).files, folder)
    job = jobs_from_manifest(folder)[0]
    root = tmp_path / "configs"
    write_table(job.path("NVIDIA H200", root), {1: META, 8: {**META, "BLOCK_M": 16}}, {})
    gen = generate(parse_spec(text, "tiny-llama"), device="NVIDIA H200 NVL", config_root=root)
    manifest = json.loads(gen.files["manifest.json"])
    sources = {
        (k["file"], k.get("group"), k.get("shape_id"), k["shape_key"]): k["meta_source"]
        for k in manifest["kernels"]
        if "meta_source" in k
    }
    key = (job.file, *(job.entry or (None, None)), job.shape_key)
    assert sources[key].startswith("tuned: NVIDIA_H200/")
    assert sum(s.startswith("default") for s in sources.values()) == len(sources) - 1
    assert manifest["device"] == "NVIDIA_H200"
    assert "'BLOCK_M': 32" in gen.files[job.file]  # the defaults use 16 and 64


def test_dry_run_lists_space_and_files():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "tune",
            str(SPECS / "llama3-70b-r40.yaml"),
            "--dry-run",
            "--device-name",
            "NVIDIA H200",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "NVIDIA_H200/gemm_fixed,k8192_n1024.json" in proc.stdout
    assert "candidates per bucket" in proc.stdout
    no_gpu = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "tune",
            str(SPECS / "tiny-llama.yaml"),
            "--device-name",
            "NVIDIA H200",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert no_gpu.returncode == 2 and no_gpu.stderr.startswith("error: timing needs a GPU")
