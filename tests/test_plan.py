"""The planner: paper numbers, shard tiling, and collectives checked against a
numpy simulation of each rank that derives its communication from the shards."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import yaml
from hypothesis import given

from dsl import build_plan, load_spec, parse_spec
from dsl.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    DOWN_REPLICATED,
    UP_SHARDED,
    LayerPlan,
)
from dsl.ranks import rank_from_ratio
from dsl.report import plan_json
from dsl.sharding import COLS, REPLICATED, ROWS
from dsl.spec import ModelConfig
from tests.conftest import SPECS
from tests.strategies import spec_dicts


def test_paper_rank_rule_gives_table_1_ranks():
    assert rank_from_ratio("smaller_dim_fraction", 0.4, (8192, 8192), 2) == 4916
    assert rank_from_ratio("smaller_dim_fraction", 0.4, (8192, 1024), 2) == 614
    assert rank_from_ratio("smaller_dim_fraction", 0.4, (8192, 28672), 2) == 4916
    # param_count: r·(in+out) <= 0.6·in·out
    r = rank_from_ratio("param_count", 0.4, (8192, 28672), 1)
    assert r * (8192 + 28672) <= 0.6 * 8192 * 28672 < (r + 1) * (8192 + 28672)


def test_llama3_70b_plan_matches_paper_dataflow():
    spec = load_spec(SPECS / "llama3-70b-r40.yaml")
    layer = spec.decomposition.layers[0].as_dict()
    assert layer == {
        "q": 4916,
        "k": 614,
        "v": 614,
        "o": 4916,
        "gate": 4916,
        "up": 4916,
        "down": 4916,
    }
    modes = plan_json(build_plan(spec, tp=8))["modes"]
    assert modes["base"]["comm_units_per_token_per_block"] == 167936
    assert modes["deinfer"]["comm_units_per_token_per_block"] == 35640
    assert modes["dense"]["comm_units_per_token_per_block"] == 32768
    assert [modes[m]["collectives_per_block"] for m in ("base", "deinfer", "dense")] == [7, 4, 2]
    kv = modes["deinfer"]["kv_elements_per_token_per_layer_per_rank"]
    assert (kv["latent"], kv["dense"], kv["auto"]) == (1228, 256, 256)
    # Base computes every head on every rank: 7/8 of its attention is duplicated.
    flops = modes["base"]["flops_per_token_per_rank"]
    assert (
        flops["duplicated_attention_per_context_token"] * 8
        == 7 * flops["attention_per_context_token"]
    )
    assert (
        modes["deinfer"]["flops_per_token_per_rank"]["duplicated_attention_per_context_token"] == 0
    )


def test_latent_cache_wins_only_at_low_tp():
    spec = load_spec(SPECS / "llama3-70b-r40.yaml")
    kv1 = plan_json(build_plan(spec, tp=1))["modes"]["deinfer"][
        "kv_elements_per_token_per_layer_per_rank"
    ]
    assert (kv1["dense"], kv1["latent"], kv1["auto"], kv1["auto_latent_layers"]) == (
        2048,
        1228,
        1228,
        80,
    )


def test_every_shipped_spec_plans_at_its_tp():
    for path in sorted(SPECS.glob("*.yaml")):
        spec = load_spec(path)
        data = plan_json(build_plan(spec))
        json.dumps(data)
        assert data["tp"] == spec.parallel.tp


# --- tiling ----------------------------------------------------------------------------


def _coverage(ranges, padded):
    count = Counter()
    for start, stop in ranges:
        count.update(range(start, stop))
    return [count[i] for i in range(padded)]


def _assert_tiles(plan_layer: LayerPlan, model: ModelConfig, tp: int) -> None:
    for f in plan_layer.factors:
        if f.split == REPLICATED:
            assert all(r == (0, f.shape[1]) for r in f.ranges), f.tensor
            continue
        # k/v split by kv heads (not base's split along r): fewer heads than ranks replicate.
        kv_replicated = (
            f.matrix in ("k", "v")
            and model.num_kv_heads < tp
            and f.split == COLS
            and plan_layer.mode != "base"
        )
        copies = tp // model.num_kv_heads if kv_replicated else 1
        assert f.padded >= f.length and f.padded - f.length < tp * max(1, model.head_dim), f.tensor
        assert _coverage(f.ranges, f.padded) == [copies] * f.padded, f.tensor
        real = [hi - lo for lo, hi in (f.real_range(i) for i in range(tp))]
        assert max(real) - min(real) <= f.padded - f.length, f.tensor
    for c in plan_layer.concats:
        # split: each column on one rank, padded to tp; whole: every rank holds all
        assert c.padding == 0 if c.whole else c.padded % tp == 0 and 0 <= c.padding < tp
        copies = tp if c.whole else 1
        assert _coverage(c.ranges, c.padded) == [copies] * c.padded
        # The segments of all ranks hold every row of every member once (per copy).
        rows = Counter()
        for rank in range(tp):
            for seg in c.segments(rank):
                rows.update((seg.member, j) for j in range(seg.src_start, seg.src_stop))
                assert seg.dst_start >= 0 and seg.dst_start + seg.width <= c.width
        assert rows == Counter({(n, j): copies for n, r in c.members for j in range(r)})


# --- simulation: every rank in numpy, collectives derived from the shards ---------------


class _Sim:
    """Runs one block's projections on ``tp`` simulated ranks for one token.

    Communication is not taken from ``plan.collectives``: an all-gather is logged when
    ranks hold column slices of one latent, an all-reduce when a factor is split along
    its contracting dimension (partial sums); the element count is the size of the
    vector that the simulation actually had to assemble.
    """

    def __init__(self, model: ModelConfig, lp: LayerPlan, tp: int, rng: np.random.Generator):
        self.model, self.lp, self.tp, self.rng = model, lp, tp, rng
        self.log: list[tuple[str, int]] = []
        self.w: dict[str, tuple[np.ndarray, ...]] = {}
        for n in model.matrices:
            n_in, n_out = model.matrix_shape(n)
            r = lp.shape.rank(n)
            self.w[n] = (
                (rng.standard_normal((n_in, r)), rng.standard_normal((r, n_out)))
                if r is not None
                else (rng.standard_normal((n_in, n_out)),)
            )

    def full(self, n: str) -> np.ndarray:
        w = self.w[n]
        return w[0] @ w[1] if len(w) == 2 else w[0]

    def all_reduce(self, parts: list[np.ndarray]) -> np.ndarray:
        self.log.append((ALL_REDUCE, parts[0].size))
        return sum(parts)

    def all_gather(self, parts: list[np.ndarray]) -> np.ndarray:
        self.log.append((ALL_GATHER, sum(p.size for p in parts)))
        return np.concatenate(parts)

    @staticmethod
    def _pad_slice(mat: np.ndarray, axis: int, lo: int, hi: int) -> np.ndarray:
        """mat[lo:hi] along ``axis`` with zero rows past the real length."""
        n = mat.shape[axis]
        part = np.take(mat, range(min(lo, n), min(hi, n)), axis=axis)
        pad = [(0, 0), (0, 0)]
        pad[axis] = (0, hi - lo - part.shape[axis])
        return np.pad(part, pad)

    def column_group(self, group: str, x: np.ndarray, names) -> list[dict[str, np.ndarray]]:
        """Returns per rank {name: local output} for a first sub-layer."""
        cat = self.lp.concat(group)
        latent = None
        if cat is not None:
            chunks = []
            for rank in range(self.tp):
                d_local = np.zeros((x.size, cat.width))
                for s in cat.segments(rank):
                    d_local[:, s.dst_start : s.dst_start + s.width] = self.w[s.member][0][
                        :, s.src_start : s.src_stop
                    ]
                chunks.append(x @ d_local)
            if cat.whole:  # every rank computed the whole latent itself
                assert all(np.array_equal(c, chunks[0]) for c in chunks)
                latent = chunks[0]
            else:
                latent = self.all_gather(chunks)
        outs = []
        for rank in range(self.tp):
            local = {}
            for n in names:
                if self.lp.shape.is_decomposed(n):
                    f = self.lp.factor(f"{n}.u")
                    off = cat.member_offset(n)
                    z = latent[off : off + self.lp.shape.rank(n)]
                    local[n] = z @ self._pad_slice(self.w[n][1], 1, *f.ranges[rank])
                else:
                    f = self.lp.factor(f"{n}.weight")
                    assert f.split == COLS
                    local[n] = x @ self._pad_slice(self.w[n][0], 1, *f.ranges[rank])
            outs.append(local)
        return outs

    def row_group(self, n: str, inputs: list[np.ndarray]) -> np.ndarray:
        if self.lp.shape.is_decomposed(n):
            f, up = self.lp.factor(f"{n}.v"), self.lp.factor(f"{n}.u")
            assert f.split == ROWS and up.split in (REPLICATED, COLS)
            parts = [
                inputs[r] @ self._pad_slice(self.w[n][0], 0, *f.ranges[r]) for r in range(self.tp)
            ]
            p = self.all_reduce(parts)
            if up.split == REPLICATED:
                return p @ self.w[n][1]
            outs = [p @ self._pad_slice(self.w[n][1], 1, *up.ranges[r]) for r in range(self.tp)]
            return self.all_gather(outs)[: up.length]
        f = self.lp.factor(f"{n}.weight")
        assert f.split == ROWS
        return self.all_reduce(
            [inputs[r] @ self._pad_slice(self.w[n][0], 0, *f.ranges[r]) for r in range(self.tp)]
        )

    def deinfer_block(self, x: np.ndarray) -> None:
        m = self.model
        qkv = self.column_group("attn", x, ("q", "k", "v"))
        for n in ("q", "k", "v"):
            want = x @ self.full(n)
            for rank in range(self.tp):
                lo, hi = self.lp.factor(
                    f"{n}.u" if self.lp.shape.is_decomposed(n) else f"{n}.weight"
                ).ranges[rank]
                np.testing.assert_allclose(qkv[rank][n], want[lo:hi], rtol=1e-9, atol=1e-9)
        attn = [o["q"] for o in qkv]  # any per-head function of the local heads will do
        q_full = x @ self.full("q")
        np.testing.assert_allclose(
            self.row_group("o", attn), q_full @ self.full("o"), rtol=1e-9, atol=1e-8
        )
        if m.mlp.kind == "glu":
            gu = self.column_group("mlp", x, ("gate", "up"))
            act = [np.tanh(o["gate"]) * o["up"] for o in gu]
            want = (np.tanh(x @ self.full("gate")) * (x @ self.full("up"))) @ self.full("down")
            got = self.row_group("down", act)
        else:
            f1 = self.column_group("mlp", x, ("fc1",))
            act = [np.maximum(o["fc1"], 0) for o in f1]
            want = np.maximum(x @ self.full("fc1"), 0) @ self.full("fc2")
            got = self.row_group("fc2", act)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-8)

    def base_block(self, x: np.ndarray) -> None:
        for n in self.model.matrices:
            n_in, _ = self.model.matrix_shape(n)
            inp = x if n_in == x.size else self.rng.standard_normal(n_in)
            if self.lp.shape.is_decomposed(n):
                d, u = self.lp.factor(f"{n}.v"), self.lp.factor(f"{n}.u")
                assert d.split == COLS and u.split == ROWS and d.ranges == u.ranges
                parts = [
                    (inp @ self._pad_slice(self.w[n][0], 1, *d.ranges[r]))
                    @ self._pad_slice(self.w[n][1], 0, *u.ranges[r])
                    for r in range(self.tp)
                ]
            else:
                f = self.lp.factor(f"{n}.weight")
                parts = [
                    self._pad_slice(inp[None, :], 1, *f.ranges[r])[0]
                    @ self._pad_slice(self.w[n][0], 0, *f.ranges[r])
                    for r in range(self.tp)
                ]
            np.testing.assert_allclose(
                self.all_reduce(parts), inp @ self.full(n), rtol=1e-9, atol=1e-8
            )

    def dense_block(self, x: np.ndarray) -> None:
        m = self.model
        cols = {n: self.lp.factor(f"{n}.weight") for n in m.matrices}
        q_local = [
            x @ self._pad_slice(self.full("q"), 1, *cols["q"].ranges[r]) for r in range(self.tp)
        ]
        got = self.all_reduce(
            [
                q_local[r] @ self._pad_slice(self.full("o"), 0, *cols["o"].ranges[r])
                for r in range(self.tp)
            ]
        )
        np.testing.assert_allclose(got, x @ self.full("q") @ self.full("o"), rtol=1e-9, atol=1e-8)
        first, last = ("gate", "down") if m.mlp.kind == "glu" else ("fc1", "fc2")
        hidden = [
            np.maximum(x @ self._pad_slice(self.full(first), 1, *cols[first].ranges[r]), 0)
            for r in range(self.tp)
        ]
        got = self.all_reduce(
            [
                hidden[r] @ self._pad_slice(self.full(last), 0, *cols[last].ranges[r])
                for r in range(self.tp)
            ]
        )
        want = np.maximum(x @ self.full(first), 0) @ self.full(last)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-8)


@given(spec_dicts())
def test_shards_tile_and_collectives_match_simulation(raw):
    spec = parse_spec(yaml.safe_dump(raw))
    tp = spec.parallel.tp
    plan = build_plan(spec)
    sharded = build_plan(spec, modes=("deinfer",), up_layout=UP_SHARDED).modes["deinfer"]
    whole = build_plan(spec, modes=("deinfer",), down_layout=DOWN_REPLICATED).modes["deinfer"]
    rng = np.random.default_rng(0)
    for mode, mp in [*plan.modes.items(), ("deinfer", sharded), ("deinfer", whole)]:
        assert sum(len(lp.layers) for lp in mp.layer_plans) == spec.model.num_layers
        for lp in mp.layer_plans:
            _assert_tiles(lp, spec.model, tp)
            sim = _Sim(spec.model, lp, tp, rng)
            getattr(sim, f"{mode}_block")(rng.standard_normal(spec.model.hidden_size))
            assert sim.log == [(c.kind, c.elements) for c in lp.collectives], mode


@given(spec_dicts())
def test_comm_units_are_layer_means_of_the_collectives(raw):
    spec = parse_spec(yaml.safe_dump(raw))
    mp = build_plan(spec).modes["deinfer"]
    total = 0
    for layer_ranks in spec.decomposition.layers:
        lp = mp.layer_plan(layer_ranks)
        total += sum(c.elements * (2 if c.kind == ALL_REDUCE else 1) for c in lp.collectives)
    assert abs(mp.comm_units_per_token_per_block() - total / spec.model.num_layers) < 1e-9


def test_cli_plan_json_top_level(capsys):
    from cli.main import main

    # the paper's layout: every decomposed matrix latent (the optimized one: test_layout)
    seventy_b = str(SPECS / "llama3-70b-r40.yaml")
    assert main(["plan", seventy_b, "--tp", "8", "--json", "--layout", "paper"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"spec", "tp", "modes"} and data["tp"] == 8
    assert set(data["modes"]) == {"deinfer", "base", "dense"}
    for mode in data["modes"].values():
        for key in (
            "comm_units_per_token_per_block",
            "collectives_per_block",
            "ring_elements_per_rank_per_token_per_block",
            "flops_per_token_per_rank",
            "weight_bytes_per_rank",
            "kv_elements_per_token_per_layer_per_rank",
        ):
            assert key in mode
    shards = data["modes"]["deinfer"]["shards"][0]
    q_u = next(f for f in shards["factors"] if f["tensor"] == "q.u")
    assert q_u["ranges"][1] == [1024, 2048] and q_u["split"] == "cols"
    segments = shards["concats"][0]["segments"]  # 768 columns a rank: q ends in chunk 6
    assert [[s[0] for s in chunk] for chunk in segments[5:]] == [["q"], ["q", "k"], ["k", "v"]]
    tiny = str(SPECS / "tiny-llama.yaml")
    assert main(["plan", tiny, "--shards", "--mode", "deinfer", "--layout", "paper"]) == 0
    assert "rank 1: q[26:27]@0, k[0:13]@1, v[0:11]@14" in capsys.readouterr().out
    assert main(["plan", str(SPECS / "llama3-70b-r40.yaml"), "--mode", "base"]) == 0
    table = capsys.readouterr().out
    assert "167,936" in table and "deinfer" not in table.split("\n")[1]
