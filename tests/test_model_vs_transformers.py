"""Our tensor-parallel model, in every mode, against a transformers model whose weights
are the products D·U of the checkpoint that `deinfer decompose` wrote (fp32)."""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from codegen.generate import generate, write_atomically
from compress.decompose import model_section
from dsl import parse_spec
from dsl.plan import UP_REPLICATED, UP_SHARDED
from runtime.dist.launcher import WorkerGroup
from tests.conftest import TP_EXAMPLES
from tests.hf_models import FAMILIES, build_hf, decompose_with_cli, hf_configs, load_products
from tests.strategies import matrix_limits
from tests.tp_workers import execution_plan, run_model

# fp32 everywhere; the sharded sums and the SVD products reorder additions.
TOL = 1e-4
# (mode, backend[, up layout]): "eager" is the dynamic (CPU) path's backend, with its weight layout
# ([out, in] storage, fused q|k|v and gate|up in dense mode).
RUNS = (
    ("deinfer", "triton"),
    ("deinfer", "torch"),
    ("base", "torch"),
    ("dense", "torch"),
    ("deinfer", "eager"),
    ("base", "eager"),
    ("dense", "eager"),
    ("deinfer", "eager", UP_SHARDED),  # o/down up factors split, outputs all-gathered
    # every matrix multiplied only whole kept in the native panel layout alone
    ("deinfer", "eager", UP_SHARDED, "released"),
    ("base", "eager", UP_REPLICATED, "released"),
    ("dense", "eager", UP_REPLICATED, "released"),
    # per-matrix layout: some matrices merged (D·U, dense shards), the others latent
    ("deinfer", "eager", UP_REPLICATED, "mixed"),
    ("deinfer", "eager", UP_SHARDED, "mixed"),
    ("deinfer", "torch", UP_REPLICATED, "mixed"),
    # the column groups' down factors whole on every rank (no latent all-gather)
    ("deinfer", "eager", UP_SHARDED, "whole_downs"),
    ("deinfer", "eager", UP_REPLICATED, "mixed", "whole_downs"),
)


@pytest.fixture(scope="module")
def groups():
    made: dict[int, WorkerGroup] = {}

    def get(world: int) -> WorkerGroup:
        if world not in made or made[world].closed:  # a fresh one after a failure
            made[world] = WorkerGroup(world, timeout_s=300)
        return made[world]

    yield get
    for g in made.values():
        g.close()


def _random_ranks(draw, section: dict) -> dict:
    """Ranks that are odd, differ between q/k/v and between layers, one matrix dense."""
    limits = matrix_limits({**section, "family": section["family"]})
    names = (
        ("q", "k", "v", "o", "fc1", "fc2")
        if section["family"] == "opt"
        else ("q", "k", "v", "o", "gate", "up", "down")
    )
    ranks = {n: draw(st.integers(1, limits[n])) for n in names}
    if draw(st.booleans()):
        ranks[draw(st.sampled_from(names))] = "dense"
    return ranks


@settings(
    max_examples=TP_EXAMPLES // 2,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_tp_model_matches_transformers(groups, tmp_path_factory, family, data):
    kwargs, tp = data.draw(hf_configs(family))
    event(f"{family} tp={tp}")
    tmp = tmp_path_factory.mktemp(family)
    hf = build_hf(family, kwargs, seed=data.draw(st.integers(0, 1000)))
    hf.save_pretrained(tmp / "dense")
    section = model_section(hf.config.to_dict())
    overrides = []
    if section["num_layers"] > 1:
        overrides.append({"layers": [1], "ranks": _random_ranks(data.draw, section)})
    raw = {
        "name": "hf",
        "model": section,
        "decomposition": {"ranks": _random_ranks(data.draw, section), "overrides": overrides},
        "parallel": {"tp": tp},
        "runtime": {"dtype": "float32"},
    }
    text = yaml.safe_dump(raw)
    (tmp / "spec.yaml").write_text(text)
    decompose_with_cli(tmp / "dense", tmp / "spec.yaml", tmp / "lowrank")
    spec = parse_spec(text)
    write_atomically(generate(parse_spec(text, "hf")).files, tmp / "gen")
    prompts = [
        data.draw(st.lists(st.integers(0, kwargs["vocab_size"] - 1), min_size=1, max_size=7))
        for _ in range(data.draw(st.integers(1, 3)))
    ]

    ref_model = load_products(hf, spec, tmp / "lowrank")
    with torch.no_grad():
        want = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in prompts])
    per_rank = groups(tp).run(
        run_model, text, str(tmp / "gen"), str(tmp / "lowrank"), prompts, RUNS
    )
    scale = max(1.0, want.abs().max().item())
    tokens = sum(len(p) for p in prompts)
    # The three modes agree with each other (not only each with the reference).
    first = per_rank[0][RUNS[0]][0]
    for run in RUNS[1:]:
        assert (per_rank[0][run][0] - first).abs().max().item() <= 2 * TOL * scale, run
    for run in RUNS:
        _, mode_plan = execution_plan(spec, tp, run)
        logits, elements = per_rank[0][run]
        err = (logits - want).abs().max().item()
        assert err <= TOL * scale, (family, run, err)
        for other in per_rank[1:]:
            assert torch.equal(other[run][0], logits), "ranks disagree"
        # The comm counter's per-block elements equal the plan's, exactly.
        expected = {}
        for lp in mode_plan.per_layer():
            for c in lp.collectives:
                expected[c.kind] = expected.get(c.kind, 0) + c.elements * tokens
        blocks = {k: v for k, v in elements.items() if ":" not in k}
        assert blocks == expected, run
