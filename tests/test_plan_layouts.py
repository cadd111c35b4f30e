"""deinfer's layouts of the factors around its collectives: the o/down up factors
replicated or split by columns, the column groups' down factors split or whole."""

from __future__ import annotations

import json

import pytest

from dsl import build_plan, load_spec, with_tp
from dsl.errors import SpecError
from dsl.plan import ALL_REDUCE, DOWN_REPLICATED, DOWN_SHARDED, UP_REPLICATED, UP_SHARDED
from dsl.sharding import COLS
from tests.conftest import SPECS


def test_sharded_up_layout_trades_weight_bytes_for_two_all_gathers():
    """llama3-70b at 40%, tp 8: the o/down up factors split by columns hold as many
    weight bytes per rank as base's fully sharded factors (not more, as replicated ones
    do), for two all-gathers of h per block (2·8192 paper units on top of 35,640)."""
    spec = load_spec(SPECS / "llama3-70b-r40.yaml")
    replicated = build_plan(spec, tp=8)
    sharded = build_plan(spec, tp=8, up_layout=UP_SHARDED).modes["deinfer"]
    assert sharded.up_layout == UP_SHARDED
    assert replicated.modes["deinfer"].up_layout == UP_REPLICATED
    assert sharded.comm_units_per_token_per_block() == 35_640 + 2 * 8192
    assert sharded.collectives_per_block() == 6 < replicated.modes["base"].collectives_per_block()
    rep_bytes = replicated.modes["deinfer"].weight_bytes_per_rank()
    base_bytes = replicated.modes["base"].weight_bytes_per_rank()
    assert sharded.weight_bytes_per_rank() <= base_bytes < rep_bytes
    o_up = sharded.layer_plans[0].factor("o.u")
    assert o_up.split == COLS and o_up.local_shape(0) == (4916, 1024)
    # tp 1 has nothing to split: the plan is the replicated one
    assert build_plan(spec, tp=1, up_layout=UP_SHARDED).modes["deinfer"].up_layout == UP_REPLICATED


def test_whole_down_factors_trade_weight_bytes_for_the_latent_all_gathers():
    """llama3-70b at 40%, tp 8, down factors whole on every rank: no all-gather of
    either latent (the two all-reduces in r are all that is left), the concatenations
    8x wider per rank; one rank holds the same down factors as tp 1."""
    spec = load_spec(SPECS / "llama3-70b-r40.yaml")
    split = build_plan(spec, tp=8).modes["deinfer"]
    whole = build_plan(spec, tp=8, down_layout=DOWN_REPLICATED).modes["deinfer"]
    assert whole.down_layout == DOWN_REPLICATED
    assert [c.kind for c in whole.layer_plans[0].collectives] == [ALL_REDUCE, ALL_REDUCE]
    for a, b in zip(split.layer_plans[0].concats, whole.layer_plans[0].concats, strict=True):
        assert b.whole and b.width == b.length == a.length and a.width == a.padded // 8
    extra = sum(c.in_features * (c.length - c.width) for c in split.layer_plans[0].concats)
    assert whole.weight_elements_per_rank() - split.weight_elements_per_rank() == extra * 80
    one = build_plan(spec, tp=1, down_layout=DOWN_REPLICATED).modes["deinfer"]
    assert one.down_layout == DOWN_SHARDED and not one.layer_plans[0].concats[0].whole
    with pytest.raises(SpecError, match="down_layout: must be one of sharded, replicated"):
        build_plan(spec, down_layout="diagonal")


def test_unknown_up_layout_names_the_field():
    spec = load_spec(SPECS / "llama3-70b-r40.yaml")
    with pytest.raises(SpecError, match="up_layout: must be one of replicated, sharded"):
        build_plan(spec, up_layout="diagonal")


@pytest.mark.parametrize(
    "shm,path,asked,want",
    [
        (False, "dynamic", "auto", DOWN_REPLICATED),  # gloo over TCP: whole
        (True, "dynamic", "auto", DOWN_SHARDED),  # shared memory: split
        (False, "static", "auto", DOWN_SHARDED),  # the generated kernels take them split
        (False, "dynamic", DOWN_SHARDED, DOWN_SHARDED),  # asked for: kept
        (True, "dynamic", DOWN_REPLICATED, DOWN_REPLICATED),
    ],
)
def test_auto_down_layout_is_whole_only_where_cpu_ranks_talk_over_gloo(shm, path, asked, want):
    from runtime.engine.config import EngineOptions, resolve

    spec = with_tp(load_spec(SPECS / "cpu-smoke.yaml"), 2)
    options = EngineOptions(shm_collectives=shm, path=path, down_layout=asked)
    facts = resolve(options, spec)
    assert facts.shm_collectives == shm  # Linux CPU ranks on one host: shared memory works
    assert facts.down_layout == want
    # one rank, or the paper's layout (its dataflow): split
    one = resolve(EngineOptions(shm_collectives=shm, path=path), with_tp(spec, 1))
    paper = resolve(EngineOptions(shm_collectives=shm, path=path, layout="paper"), spec)
    assert one.down_layout == paper.down_layout == DOWN_SHARDED


def test_plan_cli_plans_whole_down_factors(capsys):
    """``deinfer plan --down-layout replicated``: the optimized column without latent
    all-gathers beside the paper's layout, which keeps them."""
    from cli.main import main

    args = ["plan", str(SPECS / "cpu-demo.yaml"), "--tp", "2", "--json", "--link", "1gbit,1ms"]
    assert main([*args, "--down-layout", "replicated"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["down_layout"] == DOWN_REPLICATED
    moved = {
        mode: {op["what"] for group in plan["collectives"] for op in group["ops"]}
        for mode, plan in data["modes"].items()
    }
    assert not moved["deinfer"] & {"attn_latent", "mlp_latent"}
    assert {"attn_latent", "mlp_latent"} <= moved["deinfer-paper"]
