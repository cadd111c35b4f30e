"""The block dataflow of each mode, written once (docs/METHOD.md): per distinct layer
shape, the factor shards and the ordered collectives a rank runs. ``build_plan`` turns
a spec into the ``Plan`` (``dsl.plan``) that all accounting is derived from.
"""

from __future__ import annotations

from functools import partial

from dsl.errors import SpecError
from dsl.load import tp_error
from dsl.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    DOWN_LAYOUTS,
    DOWN_REPLICATED,
    DOWN_SHARDED,
    MODES,
    UP_LAYOUTS,
    UP_REPLICATED,
    UP_SHARDED,
    Collective,
    LayerPlan,
    ModePlan,
    Plan,
)
from dsl.sharding import (
    COLS,
    REPLICATED,
    ROWS,
    ConcatSplit,
    FactorShard,
    even_ranges,
    head_ranges,
    pad_to,
)
from dsl.spec import DTYPE_BYTES, LayerRanks, ModelConfig, Spec


def build_plan(
    spec: Spec,
    tp: int | None = None,
    modes: tuple[str, ...] = MODES,
    up_layout: str = UP_REPLICATED,
    down_layout: str = DOWN_SHARDED,
) -> Plan:
    """Plan ``spec`` at ``tp`` (default: the spec's) for each of ``modes``; ``up_layout``
    is how deinfer holds the o/down up factors (``dsl.plan.UP_LAYOUTS``), ``down_layout``
    its column groups' down factors (``dsl.plan.DOWN_LAYOUTS``)."""
    tp = spec.parallel.tp if tp is None else tp
    if up_layout not in UP_LAYOUTS:
        raise SpecError("up_layout", f"must be one of {', '.join(UP_LAYOUTS)}, found {up_layout!r}")
    if down_layout not in DOWN_LAYOUTS:
        raise SpecError(
            "down_layout", f"must be one of {', '.join(DOWN_LAYOUTS)}, found {down_layout!r}"
        )
    error = tp_error(spec.model, tp) if tp >= 1 else f"must be at least 1, found {tp}"
    if error:
        raise SpecError("parallel.tp", error)
    for mode in modes:
        if mode not in MODES:
            raise SpecError("mode", f"must be one of {', '.join(MODES)}, found {mode!r}")
    return Plan(
        spec=spec,
        tp=tp,
        modes={m: _mode_plan(spec, tp, m, up_layout, down_layout) for m in modes},
    )


def layer_plan_for(
    model: ModelConfig,
    shape: LayerRanks,
    tp: int,
    mode: str,
    up_layout: str = UP_REPLICATED,
    layers: tuple[int, ...] = (),
    shape_id: str = "s0",
    down_layout: str = DOWN_SHARDED,
) -> LayerPlan:
    """The plan of one layer shape on its own (``build_plan`` builds every shape's);
    what the layout choice (``tune.layout``) compares its candidates with."""
    up_layout, down_layout = _deinfer_layouts(mode, tp, up_layout, down_layout)
    deinfer = partial(_deinfer_layer, up_layout=up_layout, down_layout=down_layout)
    builder = {"deinfer": deinfer, "base": _base_layer, "dense": _dense_layer}[mode]
    return builder(model, shape, layers, tp, shape_id)


def _deinfer_layouts(mode: str, tp: int, up_layout: str, down_layout: str) -> tuple[str, str]:
    """The layouts as planned: on one rank, or outside deinfer, nothing is split."""
    if mode == "deinfer" and tp > 1:
        return up_layout, down_layout
    return UP_REPLICATED, DOWN_SHARDED


def _mode_plan(spec: Spec, tp: int, mode: str, up_layout: str, down_layout: str) -> ModePlan:
    model = spec.model
    up_layout, down_layout = _deinfer_layouts(mode, tp, up_layout, down_layout)
    layer_plans = tuple(
        layer_plan_for(
            model,
            shape,
            tp,
            mode,
            up_layout,
            spec.layers_of_shape(shape),
            f"s{i}",
            down_layout,
        )
        for i, shape in enumerate(spec.layer_shapes())
    )
    h, vocab_local = model.hidden_size, pad_to(model.vocab_size, tp) // tp
    non_layer = vocab_local * h * (1 if model.tie_word_embeddings else 2)
    non_layer += h * (2 if model.norm.kind == "layer" else 1)  # final norm (+ bias)
    if model.positions.kind == "learned":
        non_layer += (model.max_position_embeddings + model.positions.offset) * h
    non_layer += model.num_layers * _norm_elements(model)
    return ModePlan(
        mode=mode,
        tp=tp,
        layer_plans=layer_plans,
        num_layers=model.num_layers,
        non_layer_weight_elements=non_layer,
        lm_head_gather_elements=pad_to(model.vocab_size, tp),
        head_dim=model.head_dim,
        num_heads=model.num_heads,
        dtype_bytes=DTYPE_BYTES[spec.runtime.dtype],
        up_layout=up_layout,
        down_layout=down_layout,
    )


def _norm_elements(model: ModelConfig) -> int:
    """Replicated per-layer norm weights (input + post-attention, q/k norms)."""
    n = 2 * model.hidden_size * (2 if model.norm.kind == "layer" else 1)
    return n + (2 * model.head_dim if model.qk_norm else 0)


def _kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    return max(1, model.num_kv_heads // tp)


def _cols_by_heads(model: ModelConfig, name: str, tp: int) -> tuple[tuple[int, int], ...]:
    heads = model.num_heads if name == "q" else model.num_kv_heads
    return head_ranges(heads, model.head_dim, tp)


def _bias_elements(model: ModelConfig, name: str) -> bool:
    return {"q": model.bias.qkv, "k": model.bias.qkv, "v": model.bias.qkv, "o": model.bias.o}.get(
        name, model.bias.mlp
    )


def _bias_factor(model: ModelConfig, name: str, split: str, ranges, out: int) -> list[FactorShard]:
    """A bias rides with the factor producing the output: sharded like it, or replicated."""
    if not _bias_elements(model, name):
        return []
    return [FactorShard(f"{name}.bias", name, "bias", (1, out), split, ranges)]


class _DeinferBlock:
    """Collects one deinfer layer's factor shards, concat-splits and collectives."""

    def __init__(
        self, model: ModelConfig, shape: LayerRanks, tp: int, up_layout: str, down_layout: str
    ) -> None:
        self.model, self.shape, self.tp, self.up_layout = model, shape, tp, up_layout
        self.whole_downs = down_layout == DOWN_REPLICATED
        self.factors: list[FactorShard] = []
        self.concats: list[ConcatSplit] = []
        self.collectives: list[Collective] = []

    def column_group(self, group: str, names: tuple[str, ...], out_ranges: dict) -> None:
        """First sub-layer: concat-split down factors, all-gather (none where every rank
        holds the down factors whole), sharded up factors."""
        model, shape = self.model, self.shape
        decomposed = tuple(n for n in names if shape.is_decomposed(n))
        if decomposed:
            members = tuple((n, shape.rank(n)) for n in decomposed)
            n_in = model.matrix_shape(decomposed[0])[0]
            cat = ConcatSplit(group, members, n_in, self.tp, whole=self.whole_downs)
            self.concats.append(cat)
            if not cat.whole:
                self.collectives.append(Collective(ALL_GATHER, f"{group}_latent", cat.padded))
        for n in names:
            n_in, n_out = model.matrix_shape(n)
            if shape.is_decomposed(n):
                shard = FactorShard(f"{n}.u", n, "up", (shape.rank(n), n_out), COLS, out_ranges[n])
            else:
                shard = FactorShard(f"{n}.weight", n, "weight", (n_in, n_out), COLS, out_ranges[n])
            self.factors.append(shard)
            self.factors.extend(_bias_factor(model, n, COLS, out_ranges[n], n_out))

    def row_group(self, name: str, in_ranges: tuple) -> None:
        """Second sub-layer: row-parallel down factor, all-reduce in r, then the up factor
        replicated, or split by output columns with an all-gather of the output."""
        n_in, n_out = self.model.matrix_shape(name)
        full = tuple((0, n_out) for _ in range(self.tp))
        if not self.shape.is_decomposed(name):
            shard = FactorShard(f"{name}.weight", name, "weight", (n_in, n_out), ROWS, in_ranges)
            self.factors.append(shard)
            self.collectives.append(Collective(ALL_REDUCE, name, n_out))
            self.factors.extend(_bias_factor(self.model, name, REPLICATED, full, n_out))
            return
        r = self.shape.rank(name)
        self.factors.append(FactorShard(f"{name}.v", name, "down", (n_in, r), ROWS, in_ranges))
        self.collectives.append(Collective(ALL_REDUCE, f"{name}_latent", r))
        split, out_ranges = REPLICATED, full
        if self.up_layout == UP_SHARDED:
            split, out_ranges = COLS, even_ranges(n_out, self.tp)
        self.factors.append(FactorShard(f"{name}.u", name, "up", (r, n_out), split, out_ranges))
        self.factors.extend(_bias_factor(self.model, name, split, out_ranges, n_out))
        if split == COLS:
            self.collectives.append(Collective(ALL_GATHER, f"{name}_out", pad_to(n_out, self.tp)))


def _deinfer_layer(
    model: ModelConfig,
    shape: LayerRanks,
    layers,
    tp: int,
    shape_id: str,
    up_layout: str,
    down_layout: str,
) -> LayerPlan:
    block = _DeinferBlock(model, shape, tp, up_layout, down_layout)
    m_ranges = even_ranges(model.intermediate_size, tp)
    qkv = ("q", "k", "v")
    block.column_group("attn", qkv, {n: _cols_by_heads(model, n, tp) for n in qkv})
    block.row_group("o", _cols_by_heads(model, "q", tp))
    if model.mlp.kind == "glu":
        block.column_group("mlp", ("gate", "up"), {"gate": m_ranges, "up": m_ranges})
        block.row_group("down", m_ranges)
    else:
        block.column_group("mlp", ("fc1",), {"fc1": m_ranges})
        block.row_group("fc2", m_ranges)
    return LayerPlan(
        "deinfer",
        shape,
        layers,
        tuple(block.factors),
        tuple(block.concats),
        tuple(block.collectives),
        attention_heads_per_rank=model.num_heads // tp,
        kv_dense_per_rank=2 * _kv_heads_per_rank(model, tp) * model.head_dim,
        kv_latent_per_rank=_latent_kv(shape),
        kv_heads_per_rank=_kv_heads_per_rank(model, tp),
        shape_id=shape_id,
    )


def _latent_kv(shape: LayerRanks) -> int | None:
    """Latent cache: z_k and z_v, replicated on every rank. Needs both k and v
    decomposed; a layer with a dense k or v keeps the dense cache."""
    if not (shape.is_decomposed("k") and shape.is_decomposed("v")):
        return None
    return shape.rank("k") + shape.rank("v")


def _base_layer(model: ModelConfig, shape: LayerRanks, layers, tp: int, shape_id: str) -> LayerPlan:
    """Naive TP: D column-parallel (split along r), U row-parallel, all-reduce the output.
    An undecomposed W is row-parallel along its input, then all-reduced."""
    factors: list[FactorShard] = []
    collectives: list[Collective] = []
    for n in model.matrices:
        n_in, n_out = model.matrix_shape(n)
        full = tuple((0, n_out) for _ in range(tp))
        if shape.is_decomposed(n):
            r = shape.rank(n)
            r_ranges = even_ranges(r, tp)
            factors.append(FactorShard(f"{n}.v", n, "down", (n_in, r), COLS, r_ranges))
            factors.append(FactorShard(f"{n}.u", n, "up", (r, n_out), ROWS, r_ranges))
        else:
            factors.append(
                FactorShard(f"{n}.weight", n, "weight", (n_in, n_out), ROWS, even_ranges(n_in, tp))
            )
        factors.extend(_bias_factor(model, n, REPLICATED, full, n_out))
        collectives.append(Collective(ALL_REDUCE, n, n_out))
    # Every rank holds full K, V and computes every head: the duplicated attention.
    return LayerPlan(
        "base",
        shape,
        layers,
        tuple(factors),
        (),
        tuple(collectives),
        attention_heads_per_rank=model.num_heads,
        kv_dense_per_rank=2 * model.kv_width,
        kv_latent_per_rank=_latent_kv(shape),
        kv_heads_per_rank=model.num_kv_heads,
        shape_id=shape_id,
    )


def _dense_layer(
    model: ModelConfig, shape: LayerRanks, layers, tp: int, shape_id: str
) -> LayerPlan:
    """Undecomposed Megatron TP over the products D·U."""
    factors: list[FactorShard] = []
    m_ranges = even_ranges(model.intermediate_size, tp)
    for n in model.matrices:
        n_in, n_out = model.matrix_shape(n)
        full = tuple((0, n_out) for _ in range(tp))
        if n in ("q", "k", "v"):
            ranges, split = _cols_by_heads(model, n, tp), COLS
        elif n in ("gate", "up", "fc1"):
            ranges, split = m_ranges, COLS
        elif n == "o":
            ranges, split = _cols_by_heads(model, "q", tp), ROWS
        else:
            ranges, split = m_ranges, ROWS
        factors.append(FactorShard(f"{n}.weight", n, "weight", (n_in, n_out), split, ranges))
        factors.extend(
            _bias_factor(
                model,
                n,
                split if split == COLS else REPLICATED,
                ranges if split == COLS else full,
                n_out,
            )
        )
    down = "down" if model.mlp.kind == "glu" else "fc2"
    collectives = (
        Collective(ALL_REDUCE, "o", model.hidden_size),
        Collective(ALL_REDUCE, down, model.hidden_size),
    )
    return LayerPlan(
        "dense",
        shape,
        layers,
        tuple(factors),
        (),
        collectives,
        attention_heads_per_rank=model.num_heads // tp,
        kv_dense_per_rank=2 * _kv_heads_per_rank(model, tp) * model.head_dim,
        kv_latent_per_rank=None,
        kv_heads_per_rank=_kv_heads_per_rank(model, tp),
        shape_id=shape_id,
    )
