"""Checkpoint format, decompose tool and the errors of bad checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from cli.main import main as cli
from compress.decompose import svd_factors
from dsl import build_plan, load_spec, parse_spec
from runtime.model.checkpoint import CheckpointError, CheckpointReader, expected_tensors, validate
from runtime.model.weights import load_rank_weights
from tests.conftest import REPO
from tests.hf_models import TINY_LLAMA, build_hf, decompose_with_cli


@pytest.fixture(scope="module")
def decomposed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    build_hf("llama", TINY_LLAMA, seed=3).save_pretrained(tmp / "dense")
    assert (
        cli(
            [
                "decompose",
                "--model",
                str(tmp / "dense"),
                "--spec-out",
                str(tmp / "spec.yaml"),
                "--ratio",
                "0.4",
                "--rule",
                "param_count",
                "--tp",
                "2",
            ]
        )
        == 0
    )
    decompose_with_cli(tmp / "dense", tmp / "spec.yaml", tmp / "lowrank")
    return tmp


def test_spec_out_and_decompose_write_the_format(decomposed):
    spec = load_spec(decomposed / "spec.yaml")
    assert spec.model.family == "llama" and spec.parallel.tp == 2
    config = json.loads((decomposed / "lowrank" / "config.json").read_text())
    assert config["deinfer"]["ranks"][0] == spec.decomposition.layers[0].as_dict()
    index = json.loads((decomposed / "lowrank" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(spec))
    assert len(set(index["weight_map"].values())) == spec.model.num_layers + 1  # one file a layer
    validate(CheckpointReader(decomposed / "lowrank"), spec)


def test_svd_factors_are_the_best_rank_r_approximation():
    w = torch.randn(20, 12, dtype=torch.float64).float()
    d, u = svd_factors(w, 5)
    assert d.shape == (20, 5) and u.shape == (5, 12)
    s = torch.linalg.svdvals(w)
    err = torch.linalg.matrix_norm(w - d @ u, ord=2)
    assert abs(err - s[5]) < 1e-4  # Eckart–Young: the spectral error is the 6th singular value
    assert torch.allclose(d.norm(dim=0), u.norm(dim=1), rtol=1e-4)  # √Σ on both sides


def _break(decomposed, tmp_path, mutate):
    """A copy of the checkpoint with one file changed by ``mutate(tensors)``."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(decomposed / "lowrank", bad)
    first = sorted(bad.glob("model-00001-*.safetensors"))[0]
    tensors = load_file(first)
    mutate(tensors)
    save_file(tensors, first)
    return bad


Q_V = "model.layers.0.self_attn.q_proj.v.weight"


def _spec_with_index(decomposed, bad):
    """Rebuild the index for the changed file so only the tensor content differs."""
    weight_map = {}
    for f in sorted(bad.glob("model-*.safetensors")):
        for k in load_file(f):
            weight_map[k] = f.name
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return load_spec(decomposed / "spec.yaml")


CASES = {
    "shape mismatch": (
        lambda t: t.update({Q_V: torch.randn(t[Q_V].shape[0] + 1, t[Q_V].shape[1])}),
        f"tensor {Q_V}: expected shape",
    ),
    "missing tensor": (lambda t: t.pop(Q_V), f"missing tensor {Q_V}"),
    "extra tensor": (
        lambda t: t.update({"model.layers.0.surprise": torch.zeros(2)}),
        "unexpected tensor model.layers.0.surprise",
    ),
    "NaN": (
        lambda t: t[Q_V].view(-1).__setitem__(3, float("nan")),
        f"tensor {Q_V} contains NaN or Inf",
    ),
    "wrong dtype": (
        lambda t: t.update({Q_V: t[Q_V].to(torch.int32)}),
        f"tensor {Q_V}: dtype I32 is not F32, F16 or BF16",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoints_fail_with_a_clear_message(decomposed, tmp_path, case):
    mutate, message = CASES[case]
    bad = _break(decomposed, tmp_path, mutate)
    spec = _spec_with_index(decomposed, bad)
    plan = build_plan(spec)
    with pytest.raises(CheckpointError) as info:
        for rank in range(spec.parallel.tp):
            load_rank_weights(bad, spec, plan.modes["deinfer"], rank, torch.float32)
    assert message in str(info.value)
    if case == "shape mismatch":
        assert "spec rank" in str(info.value) and "checkpoint rank" in str(info.value)


def test_spec_that_does_not_match_the_model_is_rejected(decomposed, tmp_path):
    raw = yaml.safe_load((decomposed / "spec.yaml").read_text())
    raw["model"]["num_layers"] = 3
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "decompose",
            "--model",
            str(decomposed / "dense"),
            "--spec",
            str(tmp_path / "wrong.yaml"),
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: model.num_layers: spec says 3, the checkpoint's config.json says 2"
    )
    assert not (tmp_path / "out").exists()


def test_each_rank_reads_only_its_slices(decomposed):
    """A rank's tensors are its shard: together the ranks hold each factor once."""
    spec = parse_spec((decomposed / "spec.yaml").read_text())
    plan = build_plan(spec)
    a = load_rank_weights(decomposed / "lowrank", spec, plan.modes["deinfer"], 0, torch.float32)
    b = load_rank_weights(decomposed / "lowrank", spec, plan.modes["deinfer"], 1, torch.float32)
    full_q_u = load_file(sorted((decomposed / "lowrank").glob("model-00001-*"))[0])[
        "model.layers.0.self_attn.q_proj.u.weight"
    ].t()
    assert torch.equal(torch.cat([a.layers[0]["q.u"], b.layers[0]["q.u"]], dim=1), full_q_u)
