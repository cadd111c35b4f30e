"""Start-up tuning bounded by a budget of shapes, and the tuning cache: counts of shapes
timed (never seconds), the forms every shape gets, a cache that a second start reads and
that a corrupt or foreign file cannot mislead."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from runtime.kernels.cpu_gemm import choose, forms_for
from runtime.kernels.gemm_tuning import (
    TuningCache,
    cache_dir,
    machine_identity,
    shape_classes,
    tune_cpu_gemm,
)

F32, F16 = torch.float32, torch.float16


def _matrices(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """b [K, N] stored [N, K], as the dynamic path keeps its weights."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g).t() for k, n in shapes]


def _many_shapes(count: int) -> list[tuple[int, int]]:
    """``count`` distinct shapes like a model with per-layer ranks: rank x hidden and
    hidden x rank, the ranks odd and uneven."""
    hidden = (64, 96)
    shapes = []
    for i in range(count):
        rank = 3 + 2 * i
        h = hidden[i % 2]
        shapes.append((rank, h) if i % 3 else (h, rank))
    assert len(set(shapes)) == count
    return shapes


@given(
    st.dictionaries(
        st.tuples(
            st.integers(1, 4096), st.integers(1, 4096), st.sampled_from([F32, torch.float16])
        ),
        st.integers(1, 1 << 20),
        min_size=1,
        max_size=120,
    ),
    st.integers(2, 24),
)
def test_shape_classes_fit_the_budget_and_keep_dtypes_apart(weights, budget):
    rep_of = shape_classes(weights, budget)
    reps = set(rep_of.values())
    assert rep_of.keys() == weights.keys()
    assert len(reps) <= max(budget, len({k[2] for k in weights}))
    for member, rep in rep_of.items():
        assert rep in weights and rep_of[rep] == rep  # a representative is its own
        assert member[2] == rep[2]
    if len(weights) <= budget:  # few shapes: each timed itself, as before classes
        assert all(member == rep for member, rep in rep_of.items())
    assert shape_classes(dict(reversed(weights.items())), budget) == rep_of  # order-free


def test_a_budget_below_one_shape_is_refused():
    with pytest.raises(ValueError, match="budget of 0 shapes"):
        shape_classes({(4, 4, F32): 64}, 0)


def test_sixty_shapes_time_at_most_the_budget_and_a_second_start_times_none(tmp_path):
    shapes = _many_shapes(60)
    mats = _matrices(shapes)
    cache = TuningCache(tmp_path).load()
    timings, first = tune_cpu_gemm(mats, budget=6, cache=cache, rows=(1, 4), reps=1)
    assert (first.shapes, first.timed, first.cached) == (60, first.classes, 0)
    assert 1 <= first.classes <= 6
    for b in mats:  # every shape gets timings of forms it can run, in every row bucket
        per_rows = timings[(b.shape[0], b.shape[1], b.dtype)]
        assert set(per_rows) == {1, 4}
        for forms in per_rows.values():
            assert forms and set(forms) <= set(forms_for(b))
    gemm = choose(timings)
    a = torch.randn(4, shapes[7][0])
    torch.testing.assert_close(gemm(a, mats[7]), a @ mats[7], rtol=1e-5, atol=1e-5)

    again, second = tune_cpu_gemm(
        mats, budget=6, cache=TuningCache(tmp_path).load(), rows=(1, 4), reps=1
    )
    assert (second.timed, second.cached) == (0, first.classes)
    assert again == timings  # the same numbers: the same choices
    # other rows are other timings: not taken from the cache
    _, third = tune_cpu_gemm(
        mats, budget=6, cache=TuningCache(tmp_path).load(), rows=(1, 8), reps=1
    )
    assert third.timed == third.classes


def test_without_a_budget_limit_every_shape_is_timed(tmp_path):
    mats = _matrices(_many_shapes(12))
    _, report = tune_cpu_gemm(mats, budget=100, rows=(2,), reps=1)
    assert (report.shapes, report.classes, report.timed) == (12, 12, 12)


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"identity": {"cpu": "another"}, "entries": {}}), "[1, 2]"],
    ids=["corrupt", "another-machine", "not-an-object"],
)
def test_a_bad_cache_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content):
    cache = TuningCache(tmp_path)
    cache.root.mkdir(exist_ok=True)
    cache.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="runtime.kernels.gemm_tuning"):
        _, report = tune_cpu_gemm(_matrices([(8, 16)]), cache=cache.load(), rows=(1,), reps=1)
    assert report.timed == 1
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    data = json.loads(cache.path.read_text())  # replaced by a valid file of this machine
    assert data["identity"] == machine_identity() and len(data["entries"]) == 1


def test_malformed_entries_are_not_trusted(tmp_path, caplog):
    cache = TuningCache(tmp_path)
    tune_cpu_gemm(_matrices([(8, 16)]), cache=cache.load(), rows=(1,), reps=1)
    data = json.loads(cache.path.read_text())
    key = next(iter(data["entries"]))
    data["entries"][key] = {"1": {"mm": "fast"}}
    cache.path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="runtime.kernels.gemm_tuning"):
        _, report = tune_cpu_gemm(_matrices([(8, 16)]), cache=cache.load(), rows=(1,), reps=1)
    assert report.timed == 1 and "malformed" in caplog.text


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DEINFER_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("DEINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "deinfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "deinfer"


def _per_layer_model(tmp_path):
    """A tiny Llama whose every layer has ranks of its own, decomposed into
    ``tmp_path/lowrank``; returns its spec's path."""
    from compress.decompose import model_section
    from tests.hf_models import build_hf, decompose_with_cli, tiny_runtime

    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
    )
    hf = build_hf("llama", kwargs, seed=5)
    hf.save_pretrained(tmp_path / "dense")

    def ranks(i: int) -> dict[str, int]:  # each layer's ranks its own: shapes per layer
        step = {"gate": 2 * i, "up": 2 * i}
        firsts = {"q": 5, "k": 3, "v": 4, "o": 6, "gate": 9, "up": 7, "down": 11}
        return {m: r + step.get(m, i) for m, r in firsts.items()}

    overrides = [{"layers": [i], "ranks": ranks(i)} for i in range(8)]
    raw = {
        "name": "per-layer",
        "model": model_section(hf.config.to_dict()),
        "decomposition": {
            "ranks": {"q": 8, "k": 4, "v": 4, "o": 8, "gate": 16, "up": 16, "down": 16},
            "overrides": overrides,
        },
        "parallel": {"tp": 1},
        "runtime": tiny_runtime(64),
    }
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    decompose_with_cli(tmp_path / "dense", spec_path, tmp_path / "lowrank")
    return spec_path


def test_an_engine_with_per_layer_ranks_times_within_budget_then_nothing(tmp_path, monkeypatch):
    """A model whose every layer has its own ranks (more distinct shapes to time than the
    budget of 5; the MLP's and the attention's projections, which the native halves
    multiply, are panels untimed): the
    first start times at most the budget, the second none, and both decode alike; a
    cache filled ahead of time by ``deinfer tune --checkpoint`` leaves a start nothing
    to time."""
    from runtime.engine.llm import LLM
    from runtime.engine.sequence import SamplingParams
    from tests.conftest import deinfer_cli

    monkeypatch.setenv("DEINFER_CACHE_DIR", str(tmp_path / "cache"))
    spec_path = _per_layer_model(tmp_path)

    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs, reports = [], []
    for _ in range(2):
        # the paper's layout: every matrix latent, each layer's own factor shapes
        with LLM(spec_path, tmp_path / "lowrank", tp=1, tune_budget=5, layout="paper") as llm:
            reports.append(llm.tuning())
            outputs.append(llm.generate([[1, 2, 3, 4]], params)[0].token_ids)
    first, second = reports
    assert first.shapes >= 10, first
    assert 1 <= first.timed <= 5 and first.cached == 0
    assert (second.timed, second.cached) == (0, first.classes)
    assert outputs[0] == outputs[1]

    # ``deinfer tune --checkpoint`` fills a cache ahead of time: a start after it times none
    monkeypatch.setenv("DEINFER_CACHE_DIR", str(tmp_path / "ahead"))
    lowrank = str(tmp_path / "lowrank")
    ahead = deinfer_cli(
        "tune", str(spec_path), "--checkpoint", lowrank, "--tune-budget", "5", "--layout", "paper"
    )
    assert ahead.returncode == 0, ahead.stderr
    assert f"{first.timed} timed, 0 from the cache" in ahead.stdout
    with LLM(str(spec_path), lowrank, tp=1, tune_budget=5, layout="paper") as llm:
        assert (llm.tuning().timed, llm.tuning().cached) == (0, first.classes)
