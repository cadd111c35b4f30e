"""The sharding and communication plan of a spec, for each mode and a TP degree.

A ``Plan`` holds, per mode, one ``LayerPlan`` per distinct layer shape: the factor
shards plus the ordered collectives (written by ``dsl.dataflow``); accounting (comm
units, ring elements, FLOPs, weight bytes, KV elements) and the derived facts the
code generator and the runtime share (shape ids, K/V heads per rank, the cache each
layer holds, latent widths) are properties computed from it, here only.

Modes:
* ``deinfer`` — concat-split down factors, all-gather in the latent space, up
  factors sharded by heads / columns of m, row-parallel o/down down-factors with an
  all-reduce of width r, then the o/down up-factors either replicated (the paper's
  layout, ``UP_REPLICATED``) or split by output columns and their outputs all-gathered
  (``UP_SHARDED``: fewer weight bytes per rank for one more collective each); the
  column groups' down factors split (the paper) or whole on every rank
  (``DOWN_REPLICATED``: no latent all-gather, for more weight bytes per rank).
* ``base`` — naive TP: every factor pair is a Megatron pair with an all-reduce of
  the full output (7 per block); every rank computes all heads.
* ``dense`` — undecomposed Megatron TP (the products D·U): 2 all-reduces of h.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsl.sharding import (
    COLS,
    ConcatSplit,
    FactorShard,
)
from dsl.spec import LayerRanks, Spec

MODES = ("deinfer", "base", "dense")
ALL_GATHER, ALL_REDUCE = "all_gather", "all_reduce"
# How deinfer lays out the up factors of o and down (fc2), after the all-reduce in r.
UP_REPLICATED, UP_SHARDED = "replicated", "sharded"
UP_LAYOUTS = (UP_REPLICATED, UP_SHARDED)
# How deinfer lays out a column group's concatenated down factors: split by columns, the
# latent all-gathered (the paper), or whole on every rank, each computing the whole
# latent (no all-gather, for the down factors' bytes on every rank).
DOWN_SHARDED, DOWN_REPLICATED = "sharded", "replicated"
DOWN_LAYOUTS = (DOWN_SHARDED, DOWN_REPLICATED)
# The matrices that share one input norm and one projection (a deinfer column group's
# concatenated down factors; the native decode block fuses each group's products).
COLUMN_GROUPS = (("q", "k", "v"), ("gate", "up"), ("fc1",))


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
    kv_heads_per_rank: int  # K/V heads this rank attends with (all of them in base)
    shape_id: str  # "s<i>": the i-th distinct layer shape of the spec (file names)

    def cache_kind(self, requested: str) -> str:
        """dense | latent: the cache this layer holds when ``requested`` (dense | latent |
        auto) is asked for. Only deinfer layers with decomposed k and v can hold a latent
        cache (the others keep the dense one); ``auto`` takes it only where it is
        strictly smaller than the dense shard."""
        latent = self.kv_latent_per_rank
        if self.mode != "deinfer" or latent is None or requested == "dense":
            return "dense"
        if requested == "auto" and latent >= self.kv_dense_per_rank:
            return "dense"
        return "latent"

    def kv_per_rank(self, kind: str) -> int:
        """Elements per token of the cache this layer holds under ``kind``."""
        if self.cache_kind(kind) == "latent":
            return self.kv_latent_per_rank
        return self.kv_dense_per_rank

    def factor(self, tensor: str) -> FactorShard:
        for f in self.factors:
            if f.tensor == tensor:
                return f
        raise KeyError(tensor)

    def split_row_ups(self) -> tuple[FactorShard, ...]:
        """deinfer's o/down up factors split by output columns (``UP_SHARDED``): each
        rank computes its columns and an all-gather assembles the output. Empty when
        they are replicated (the column groups' up factors run on the gathered latent)."""
        in_concats = {n for c in self.concats for n, _ in c.members}
        return tuple(
            f
            for f in self.factors
            if f.factor == "up" and f.split == COLS and f.matrix not in in_concats
        )

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

    def weight_elements(self, rank: int = 0) -> int:
        """Weight elements rank ``rank`` holds for one layer of this plan."""
        n = sum(c.in_features * c.width for c in self.concats)
        return n + sum(r * c for r, c in (f.local_shape(rank) for f in self.factors))

    def kv_auto_is_latent(self) -> bool:
        return self.cache_kind("auto") == "latent"


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
    up_layout: str = UP_REPLICATED  # deinfer's o/down up factors (UP_LAYOUTS)
    down_layout: str = DOWN_SHARDED  # deinfer's column groups' down factors (DOWN_LAYOUTS)

    def layer_plan(self, ranks: LayerRanks) -> LayerPlan:
        """The plan of a layer with these ranks (layers of equal ranks share one)."""
        return next(lp for lp in self.layer_plans if lp.shape == ranks)

    def per_layer(self) -> tuple[LayerPlan, ...]:
        """Each transformer layer's plan, by index (a layer whose merged matrices run
        as dense shards has the plan of its execution ranks, not of its checkpoint's)."""
        by_index = {i: lp for lp in self.layer_plans for i in lp.layers}
        return tuple(by_index[i] for i in range(self.num_layers))

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
        per_layer = sum(lp.weight_elements(rank) * len(lp.layers) for lp in self.layer_plans)
        return per_layer + self.non_layer_weight_elements

    def weight_bytes_per_rank(self, rank: int = 0) -> int:
        return self.weight_elements_per_rank(rank) * self.dtype_bytes

    def kv_elements(self, kind: str) -> float | None:
        """Mean over layers of KV elements per token per layer per rank for ``kind`` in
        dense | latent | auto; None for latent where no layer can hold a latent cache."""
        if kind == "latent" and not self.latent_widths():
            return None
        return self._layer_mean(lambda lp: lp.kv_per_rank(kind))

    def latent_widths(self, requested: str = "latent") -> list[int]:
        """The distinct per-token widths of the latent caches held under ``requested``
        (one copy kernel and one staging buffer each)."""
        return sorted(
            {
                lp.kv_latent_per_rank
                for lp in self.layer_plans
                if lp.cache_kind(requested) == "latent"
            }
        )

    def auto_latent_layers(self) -> int:
        return sum(len(lp.layers) for lp in self.layer_plans if lp.kv_auto_is_latent())


@dataclass(frozen=True)
class Plan:
    spec: Spec
    tp: int
    modes: dict[str, ModePlan] = field(default_factory=dict)
