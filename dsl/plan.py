"""The sharding and communication plan of a spec, for each mode and a TP degree.

The block dataflow of each mode (docs/METHOD.md) is written once here, as a list
of factor shards plus the ordered collectives; accounting (comm units, ring
elements, FLOPs, weight bytes, KV elements) is derived from that list.

Modes:
* ``deinfer`` — concat-split down factors, all-gather in the latent space, up
  factors sharded by heads / columns of m, row-parallel o/down down-factors with an
  all-reduce of width r, replicated o/down up-factors.
* ``base`` — naive TP: every factor pair is a Megatron pair with an all-reduce of
  the full output (7 per block); every rank computes all heads.
* ``dense`` — undecomposed Megatron TP (the products D·U): 2 all-reduces of h.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsl.errors import SpecError
from dsl.load import tp_error
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

MODES = ("deinfer", "base", "dense")
ALL_GATHER, ALL_REDUCE = "all_gather", "all_reduce"


@dataclass(frozen=True)
class Collective:
    kind: str  # ALL_GATHER | ALL_REDUCE
    what: str  # the tensor it moves, e.g. "attn_latent", "o_latent", "q"
    elements: int  # per token: the full (gathered / reduced) vector length

    @property
    def units(self) -> int:
        """Paper units: all-gather n, all-reduce 2n."""
        return self.elements * (2 if self.kind == ALL_REDUCE else 1)

    def ring_elements_per_rank(self, tp: int) -> float:
        """Elements each rank sends in a ring algorithm."""
        return self.units * (tp - 1) / tp


@dataclass(frozen=True)
class LayerPlan:
    """One distinct layer shape in one mode at one TP degree."""

    mode: str
    shape: LayerRanks
    layers: tuple[int, ...]
    factors: tuple[FactorShard, ...]
    concats: tuple[ConcatSplit, ...]
    collectives: tuple[Collective, ...]
    attention_heads_per_rank: int  # heads each rank computes (all of them in base)
    kv_dense_per_rank: int  # elements per token of this rank's dense K,V cache
    kv_latent_per_rank: int | None  # same for the latent cache; None where not possible

    def kv_per_rank(self, kind: str) -> int:
        """Elements per token of the cache this layer uses under ``kind``
        (dense | latent | auto); a layer that cannot hold a latent cache keeps the dense one."""
        latent = self.kv_latent_per_rank
        if (
            latent is None
            or kind == "dense"
            or (kind == "auto" and latent >= self.kv_dense_per_rank)
        ):
            return self.kv_dense_per_rank
        return latent

    def factor(self, tensor: str) -> FactorShard:
        for f in self.factors:
            if f.tensor == tensor:
                return f
        raise KeyError(tensor)

    def concat(self, name: str) -> ConcatSplit | None:
        return next((c for c in self.concats if c.name == name), None)

    def gemm_flops_per_token(self, rank: int) -> int:
        """2·in·out of every local GEMM (padded shapes: what actually runs)."""
        total = 0
        for c in self.concats:
            total += 2 * c.in_features * c.width
        for f in self.factors:
            if f.factor != "bias":
                rows, cols = f.local_shape(rank)
                total += 2 * rows * cols
        return total

    def kv_auto_is_latent(self) -> bool:
        """``auto`` picks the latent cache only where it is strictly smaller."""
        return (
            self.kv_latent_per_rank is not None and self.kv_latent_per_rank < self.kv_dense_per_rank
        )


@dataclass(frozen=True)
class ModePlan:
    mode: str
    tp: int
    layer_plans: tuple[LayerPlan, ...]
    num_layers: int
    non_layer_weight_elements: int  # embeddings, LM head, final norm on one rank
    lm_head_gather_elements: int  # logits all-gather per token (vocab, padded)
    head_dim: int
    num_heads: int
    dtype_bytes: int

    def layer_plan(self, ranks: LayerRanks) -> LayerPlan:
        """The plan of a layer with these ranks (layers of equal ranks share one)."""
        return next(lp for lp in self.layer_plans if lp.shape == ranks)

    def _layer_mean(self, value) -> float:
        return sum(value(lp) * len(lp.layers) for lp in self.layer_plans) / self.num_layers

    def comm_units_per_token_per_block(self) -> float:
        return self._layer_mean(lambda lp: sum(c.units for c in lp.collectives))

    def collectives_per_block(self) -> float:
        return self._layer_mean(lambda lp: len(lp.collectives))

    def ring_elements_per_rank_per_token_per_block(self) -> float:
        return self._layer_mean(
            lambda lp: sum(c.ring_elements_per_rank(self.tp) for c in lp.collectives)
        )

    def gemm_flops_per_token_per_rank(self, rank: int = 0) -> int:
        return sum(lp.gemm_flops_per_token(rank) * len(lp.layers) for lp in self.layer_plans)

    def attention_flops_per_context_token_per_rank(self) -> int:
        """QKᵀ and PV: 4·d per head per context token, summed over layers."""
        return sum(
            4 * self.head_dim * lp.attention_heads_per_rank * len(lp.layers)
            for lp in self.layer_plans
        )

    def duplicated_attention_flops(self) -> int:
        """Attention FLOPs above the 1/tp share of heads: base's duplicated work."""
        own = self.num_heads // self.tp
        return sum(
            4 * self.head_dim * (lp.attention_heads_per_rank - own) * len(lp.layers)
            for lp in self.layer_plans
        )

    def weight_elements_per_rank(self, rank: int = 0) -> int:
        per_layer = 0
        for lp in self.layer_plans:
            n = sum(c.in_features * c.width for c in lp.concats)
            n += sum(r * c for r, c in (f.local_shape(rank) for f in lp.factors))
            per_layer += n * len(lp.layers)
        return per_layer + self.non_layer_weight_elements

    def weight_bytes_per_rank(self, rank: int = 0) -> int:
        return self.weight_elements_per_rank(rank) * self.dtype_bytes

    def kv_elements(self, kind: str) -> float | None:
        """Mean over layers of KV elements per token per layer per rank for ``kind`` in
        dense | latent | auto; None for latent where no layer can hold a latent cache."""
        if kind == "latent" and all(lp.kv_latent_per_rank is None for lp in self.layer_plans):
            return None
        return self._layer_mean(lambda lp: lp.kv_per_rank(kind))

    def auto_latent_layers(self) -> int:
        return sum(len(lp.layers) for lp in self.layer_plans if lp.kv_auto_is_latent())


@dataclass(frozen=True)
class Plan:
    spec: Spec
    tp: int
    modes: dict[str, ModePlan] = field(default_factory=dict)


def build_plan(spec: Spec, tp: int | None = None, modes: tuple[str, ...] = MODES) -> Plan:
    """Plan ``spec`` at ``tp`` (default: the spec's) for each of ``modes``."""
    tp = spec.parallel.tp if tp is None else tp
    error = tp_error(spec.model, tp) if tp >= 1 else f"must be at least 1, found {tp}"
    if error:
        raise SpecError("parallel.tp", error)
    for mode in modes:
        if mode not in MODES:
            raise SpecError("mode", f"must be one of {', '.join(MODES)}, found {mode!r}")
    return Plan(spec=spec, tp=tp, modes={m: _mode_plan(spec, tp, m) for m in modes})


def _mode_plan(spec: Spec, tp: int, mode: str) -> ModePlan:
    model = spec.model
    builder = {"deinfer": _deinfer_layer, "base": _base_layer, "dense": _dense_layer}[mode]
    layer_plans = tuple(
        builder(model, shape, spec.layers_of_shape(shape), tp) for shape in spec.layer_shapes()
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


def _deinfer_layer(model: ModelConfig, shape: LayerRanks, layers, tp: int) -> LayerPlan:
    factors: list[FactorShard] = []
    concats: list[ConcatSplit] = []
    collectives: list[Collective] = []
    m_ranges = even_ranges(model.intermediate_size, tp)

    def column_group(group: str, names: tuple[str, ...], out_ranges: dict[str, tuple]) -> None:
        """First sub-layer: concat-split down factors, all-gather, sharded up factors."""
        decomposed = tuple(n for n in names if shape.is_decomposed(n))
        if decomposed:
            cat = ConcatSplit(
                group,
                tuple((n, shape.rank(n)) for n in decomposed),
                model.matrix_shape(decomposed[0])[0],
                tp,
            )
            concats.append(cat)
            collectives.append(Collective(ALL_GATHER, f"{group}_latent", cat.padded))
        for n in names:
            n_in, n_out = model.matrix_shape(n)
            if shape.is_decomposed(n):
                factors.append(
                    FactorShard(f"{n}.u", n, "up", (shape.rank(n), n_out), COLS, out_ranges[n])
                )
            else:
                factors.append(
                    FactorShard(f"{n}.weight", n, "weight", (n_in, n_out), COLS, out_ranges[n])
                )
            factors.extend(_bias_factor(model, n, COLS, out_ranges[n], n_out))

    def row_group(name: str, in_ranges: tuple) -> None:
        """Second sub-layer: row-parallel down factor, all-reduce in r, replicated up."""
        n_in, n_out = model.matrix_shape(name)
        full = tuple((0, n_out) for _ in range(tp))
        if shape.is_decomposed(name):
            r = shape.rank(name)
            factors.append(FactorShard(f"{name}.v", name, "down", (n_in, r), ROWS, in_ranges))
            collectives.append(Collective(ALL_REDUCE, f"{name}_latent", r))
            factors.append(FactorShard(f"{name}.u", name, "up", (r, n_out), REPLICATED, full))
        else:
            factors.append(
                FactorShard(f"{name}.weight", name, "weight", (n_in, n_out), ROWS, in_ranges)
            )
            collectives.append(Collective(ALL_REDUCE, name, n_out))
        factors.extend(_bias_factor(model, name, REPLICATED, full, n_out))

    qkv = ("q", "k", "v")
    column_group("attn", qkv, {n: _cols_by_heads(model, n, tp) for n in qkv})
    row_group("o", _cols_by_heads(model, "q", tp))
    if model.mlp.kind == "glu":
        column_group("mlp", ("gate", "up"), {"gate": m_ranges, "up": m_ranges})
        row_group("down", m_ranges)
    else:
        column_group("mlp", ("fc1",), {"fc1": m_ranges})
        row_group("fc2", m_ranges)
    return LayerPlan(
        "deinfer",
        shape,
        layers,
        tuple(factors),
        tuple(concats),
        tuple(collectives),
        attention_heads_per_rank=model.num_heads // tp,
        kv_dense_per_rank=2 * _kv_heads_per_rank(model, tp) * model.head_dim,
        kv_latent_per_rank=_latent_kv(shape),
    )


def _latent_kv(shape: LayerRanks) -> int | None:
    """Latent cache: z_k and z_v, replicated on every rank. Needs both k and v
    decomposed; a layer with a dense k or v keeps the dense cache."""
    if not (shape.is_decomposed("k") and shape.is_decomposed("v")):
        return None
    return shape.rank("k") + shape.rank("v")


def _base_layer(model: ModelConfig, shape: LayerRanks, layers, tp: int) -> LayerPlan:
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
    )


def _dense_layer(model: ModelConfig, shape: LayerRanks, layers, tp: int) -> LayerPlan:
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
    )
