"""deinfer's per-matrix layout: the execution spec (merged matrices undecomposed), the
cost model's choice over every subset of a shape's matrices, a merged shard read from
the factors, and ``deinfer plan``'s report of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsl import build_plan, load_spec, parse_spec, with_ratio, with_tp
from dsl.errors import SpecError
from dsl.layout import with_merged
from dsl.sharding import COLS, ROWS
from runtime.model.checkpoint import CheckpointReader, names_for
from runtime.model.weights import CheckpointSource
from runtime.tools.random_checkpoint import write_random_checkpoint
from tests.conftest import REPO, SPECS
from tests.strategies import spec_dicts
from tune.cost_model import Workload, predict_block
from tune.layout import choose_layout, merges_of
from tune.profiles import builtin_profiles, load_profile

SEVENTY_B = SPECS / "llama3-70b-r40.yaml"


def test_merged_matrices_run_undecomposed_and_only_decomposed_ones_merge():
    spec = load_spec(SPECS / "cpu-smoke.yaml")
    shape = spec.layer_shapes()[0]
    executed = with_merged(spec, {shape: frozenset({"q", "down"})})
    for ranks in executed.decomposition.layers:
        assert ranks.rank("q") is None and ranks.rank("down") is None
    assert executed.decomposition.layers[0].rank("k") == shape.rank("k")
    merged = [
        {n for n, r in ranks.ranks if r is not None and run.rank(n) is None}
        for ranks, run in zip(spec.decomposition.layers, executed.decomposition.layers, strict=True)
    ]
    assert merged == [{"q", "down"}] * spec.model.num_layers
    assert with_merged(spec, {}) is spec
    with pytest.raises(SpecError, match="layout: fc1 is not a decomposed matrix"):
        with_merged(spec, {shape: frozenset({"fc1"})})


@settings(max_examples=25, deadline=None)
@given(spec_dicts(), st.sampled_from(builtin_profiles()), st.integers(1, 32))
def test_the_choice_is_never_predicted_slower_than_the_paper_or_dense(raw, profile, batch):
    spec = parse_spec(yaml.safe_dump(raw))
    dev = load_profile(profile)
    for c in choose_layout(spec, dev, Workload(batch, 64)):
        assert c.seconds <= min(c.paper_s, c.dense_s) * (1 + 1e-9)
        for m in c.matrices:  # each matrix's alternative is no faster than its choice
            assert c.seconds <= min(m.latent_s, m.merged_s) * (1 + 1e-9)


def test_square_factors_larger_than_the_matrix_are_merged_at_tp_1():
    """At the paper's rule q and o hold 1.2x their matrix: merged on every profile; the
    MLP's factors (0.77x) stay latent where nothing is communicated."""
    spec = with_ratio(load_spec(SPECS / "cpu-demo.yaml"), 0.4)
    for profile in builtin_profiles():
        (choice,) = choose_layout(with_tp(spec, 1), load_profile(profile), Workload(16, 512))
        assert {"q", "o"} <= choice.merged and not {"gate", "up"} & choice.merged, profile


def test_a_latent_cache_keeps_k_and_v_latent():
    spec = with_tp(with_ratio(load_spec(SPECS / "cpu-demo.yaml"), 0.4), 4)
    dev = load_profile("a800-nvlink")
    free = choose_layout(spec, dev, Workload(16, 512))[0].merged
    kept = choose_layout(spec, dev, Workload(16, 512, "latent"), keep_latent_kv=True)[0]
    assert {"k", "v"} <= free and not {"k", "v"} & kept.merged
    executed = with_merged(spec, {kept.shape: kept.merged})
    assert build_plan(executed).modes["deinfer"].latent_widths()


@pytest.mark.parametrize("profile", ["a800-pcie", "a800-nvlink"])
def test_seventy_b_at_tp_8_holds_no_more_than_dense_and_is_predicted_no_slower(profile):
    spec = with_tp(load_spec(SEVENTY_B), 8)
    dev, work = load_profile(profile), Workload(16, 1024)
    executed = with_merged(spec, merges_of(choose_layout(spec, dev, work)))
    optimized = build_plan(executed, modes=("deinfer",)).modes["deinfer"]
    dense = build_plan(spec, modes=("dense",)).modes["dense"]
    assert optimized.weight_bytes_per_rank() <= dense.weight_bytes_per_rank()
    step = predict_block(optimized, dev, work).total_s
    assert step <= predict_block(dense, dev, work).total_s * (1 + 1e-9)


def test_a_merged_shard_is_the_slice_of_the_product(tmp_path):
    spec = load_spec(SPECS / "cpu-smoke.yaml")
    write_random_checkpoint(spec, tmp_path, seed=3)
    reader = CheckpointReader(tmp_path)
    names = names_for(spec.model)
    source = CheckpointSource(reader, names, 1, spec.decomposition.layers[1])
    for matrix, split in (("q", COLS), ("o", ROWS), ("up", COLS), ("down", ROWS)):
        base = names.layer(1, matrix)
        d = reader.read(f"{base}.v.weight").t().float()
        u = reader.read(f"{base}.u.weight").t().float()
        full = d @ u
        n = full.shape[1 if split == COLS else 0]
        start, stop = n // 3, n // 3 + n // 2
        got = source.factor(f"{matrix}.weight", split, start, stop).float()
        want = full[:, start:stop] if split == COLS else full[start:stop]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32 rounding


def test_plan_cli_shows_each_matrix_choice_and_the_step_against_dense():
    def plan(*args):
        cmd = [sys.executable, "-m", "cli.main", "plan", str(SEVENTY_B), "--tp", "8", *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)

    out = plan("--device", "a800-pcie")
    assert out.returncode == 0, out.stderr
    assert "deinfer layout (optimized) on a800-pcie" in out.stdout
    assert "q:M" in out.stdout and "predicted block step: deinfer" in out.stdout
    data = json.loads(plan("--device", "a800-nvlink", "--batch", "1", "--json").stdout)
    steps = data["layout"]["predicted_block_step_s"]
    assert set(steps) == {"deinfer", "deinfer-paper", "base", "dense"}
    assert steps["deinfer"] <= steps["dense"] * (1 + 1e-9) < steps["deinfer-paper"]
    assert data["layout"]["batch"] == 1 and data["layout"]["shapes"][0]["merged"]
    bad = plan("--device", "nowhere")
    assert bad.returncode == 2 and "device profile 'nowhere' not found" in bad.stderr
