"""A layer's decode step as two native calls (``runtime.kernels.decode_block``): the
attention half and the MLP half, each ending in its row product not yet reduced (the
pending summand of the next norm). Made once per layer that it covers, after the tuned
products have packed the layer's matrices as panels (``DecodeBlock.of``); the layer uses
it for decode steps whose batch offers the layer's dense cache, and its own ops
otherwise (prefill, latent caches, a library that did not build).

It covers the Llama-like layer: RMSNorm without bias, no biases or q/k norms, RoPE, a
SiLU GLU, fp32 on the CPU; each projection dense (a column group fused into one matrix,
``DecoderLayer.FUSED``) or low-rank (down factor, then up factors; a column group's
down factors concatenated). At batch 1 on the Intel Xeon VM the products took 18 of a
28 ms step of the 135M model and the ops between them the rest (``native/decode_block.c``).

Across ranks (deinfer's latent dataflow) a half is cut at its collectives: a low-rank
column group's down factors' shard is one call (``ColumnProjection.first``), the ranks
all-gather its latent, and the rest of the half runs from that latent (its up factors,
``ColumnProjection.ups``); a low-rank row projection ends at its down factor's shard
(the latent of width r, which the layer all-reduces and multiplies by the up factor:
where every rank holds that factor whole, at the start of the next half's first call,
``PendingUp``). A column group whose down factors every rank holds whole is one call, as
on one rank.

A layer over a latent cache runs the MLP half alone (``MlpHalf``) after its attention:
on one rank q (rotated) and the k|v latent in one native call (``LatentAttentionHalf``),
then one native latent attention (``runtime.model.eager_attention``), and the heads'
output times W_o in the MLP half's call, which adds it to x; else the attention op by
op, its output added by the MLP half's call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsl.spec import ModelConfig
from runtime.kernels.cpu_gemm import ReleasedMatrix
from runtime.kernels.decode_block import DecodeBlockLibrary, Projection, decode_block_library
from runtime.kernels.latent_scores import LatentAttention
from runtime.kernels.panel import panel_library
from runtime.model.paged_cache import DenseDecodeCache, LatentDecodeCache
from runtime.model.pending_up import Summand, apart

# The ranks' all-gather of a latent's columns ([m, w] on each rank -> [m, world * w])
Gather = Callable[[torch.Tensor], torch.Tensor]

# Each projection of the block: its dense matrix's name (a column group's fused as
# ``DecoderLayer.FUSED`` makes it), and its low-rank form: the down factor's name (a
# column group's concatenated down factors) and the members whose up factors follow,
# in the order of the block's columns.
PROJECTIONS = {
    "qkv": ("qkv.weight", "attn.cat", ("q", "k", "v")),
    "o": ("o.weight", "o.v", ("o",)),
    "gate_up": ("gate_up.weight", "mlp.cat", ("gate", "up")),
    "down": ("down.weight", "down.v", ("down",)),
}


# The row projections: across ranks the block ends them at their down factors' shard.
ROWS = ("o", "down")
# The MLP half's projections (a latent-cache layer's decode runs this half alone)
MLP_PROJECTIONS = ("gate_up", "down")


def matrices_of(
    weights: dict[str, object],
    across_ranks: bool = False,
    keys: tuple[str, ...] = tuple(PROJECTIONS),
) -> list[str] | None:
    """The names of the matrices the block's projections ``keys`` multiply, each dense
    or low-rank as ``weights`` (the layer's, by name) hold it; None where one is neither
    (a column group part merged, part low-rank). ``across_ranks``: not a low-rank row
    projection's up factor (the layer multiplies it after the all-reduce)."""
    names: list[str] = []
    for key in keys:
        dense, down, members = PROJECTIONS[key]
        if dense in weights:
            names.append(dense)
        elif down in weights and all(f"{n}.u" in weights for n in members):
            ups = [] if across_ranks and key in ROWS else [f"{n}.u" for n in members]
            names += [down, *ups]
        else:
            return None
    return names


def covers(
    model: ModelConfig,
    weights: dict[str, object],
    across_ranks: bool = False,
    keys: tuple[str, ...] = tuple(PROJECTIONS),
) -> bool:
    """Whether the decode block computes a layer of ``model`` with these weights (by
    name as ``DecoderLayer.w`` has them; before or after packing), or with ``keys``
    ``MLP_PROJECTIONS`` its MLP half."""
    plain = (
        model.norm.kind == "rms"
        and model.mlp.kind == "glu"
        and model.mlp.activation == "silu"
        and not model.qk_norm
        and model.positions.kind == "rope"
        and model.positions.style in ("neox", "gptj")
    )
    names = matrices_of(weights, across_ranks, keys)
    biases = any(name.endswith(".bias") for name in weights)
    fp32 = names is not None and all(
        getattr(weights[name], "dtype", None) == torch.float32
        for name in (*names, "input_norm.weight", "post_norm.weight")
    )
    built = decode_block_library() is not None and panel_library() is not None
    return plain and not biases and fp32 and built


def _rope_half(model: ModelConfig) -> int:
    """RoPE's pairs as the native calls take them: j with j + half (neox), or adjacent (0)."""
    return model.head_dim // 2 if model.positions.style == "neox" else 0


def held_as_panels(weights: dict[str, object], name: str) -> ReleasedMatrix | None:
    """The matrix ``name`` where the tuned products hold it as panels alone, else None."""
    m = weights.get(name)
    return m if isinstance(m, ReleasedMatrix) and m.form.kind == "panel" else None


@dataclass(frozen=True)
class ColumnProjection:
    """A column group's projection from the normed input: whole (``ups`` None), or cut
    where the ranks all-gather its latent: ``first`` the group's down factors' shard
    (dense: one matrix), ``ups`` its up factors, from the gathered latent."""

    first: Projection
    ups: Projection | None = None

    @property
    def out_width(self) -> int:
        return (self.ups or self.first).out_width


def _projection(
    weights: dict[str, object], key: str, world: int
) -> Projection | ColumnProjection | None:
    """The projection ``key`` of ``PROJECTIONS`` as panels (a ``ColumnProjection`` for
    a column group), or None where a matrix is not held as panels alone (the tuned
    products chose another form) or a low-rank group's latent is not its ranks' sum."""
    dense, down, members = PROJECTIONS[key]
    row = key in ROWS
    if dense in weights:
        m = held_as_panels(weights, dense)
        whole = None if m is None else Projection(m.copy, m.shape[1])
        return whole if row or whole is None else ColumnProjection(whole)
    across = world > 1
    ups_held = () if across and row else (f"{n}.u" for n in members)
    held = [held_as_panels(weights, name) for name in (down, *ups_held)]
    if any(m is None for m in held):
        return None
    first, *ups = held
    if not ups:  # a row projection across ranks: its latent's shard of the sum
        return Projection(first.copy, first.shape[1])
    ranks = sum(u.shape[0] for u in ups)
    factors = tuple((u.copy, *u.shape) for u in ups)
    # one call where this rank's down factors give the whole latent (one rank, or the
    # down factors whole on every rank): the latent stays in the call's scratch
    if first.shape[1] == ranks:
        whole = Projection(first.copy, first.shape[1], factors)
        return whole if row else ColumnProjection(whole)
    if not across:
        return None
    if not ranks <= first.shape[1] * world:  # the gathered latent holds every member's rows
        return None
    return ColumnProjection(Projection(first.copy, first.shape[1]), Projection(None, 0, factors))


def _input(
    library: DecodeBlockLibrary,
    x: torch.Tensor,
    parts: list[torch.Tensor],
    after: tuple[torch.Tensor, Projection] | None,
    norm: tuple[torch.Tensor, float],
    columns: ColumnProjection,
    gather: Gather,
) -> tuple[torch.Tensor, list[torch.Tensor], tuple | None, Projection, tuple | None]:
    """What a half's call starts from: x, its summands, the product to add too
    (``after``, (a latent, its projection) or None) and norm, and the whole projection;
    or, cut, the latent the ranks gathered (x += summands and that product by the first
    call) and the up factors."""
    if columns.ups is None:
        return x, parts, norm, columns.first, after
    latent = gather(library.norm_project(x, parts, norm, columns.first, after))
    return latent, [], None, columns.ups, None


@dataclass(frozen=True)
class MlpHalf:
    """The MLP half of the block: a full block's second call, and alone the native part
    of a latent-cache layer's decode step (its attention reads the latents op by op,
    ``runtime.model.eager_attention``)."""

    library: DecodeBlockLibrary
    eps: float
    post_norm: torch.Tensor
    gate_up: ColumnProjection
    inter: int  # this rank's MLP columns
    down: Projection  # whole, or across ranks its shard (Megatron's, or the down factor's)

    @staticmethod
    def of(model: ModelConfig, weights: dict[str, object], world: int = 1) -> MlpHalf | None:
        """The MLP half of a layer with these weights (as ``DecodeBlock.of``), or None."""
        gate_up, down = (_projection(weights, key, world) for key in MLP_PROJECTIONS)
        if gate_up is None or down is None:
            return None
        h, inter = weights["post_norm.weight"].shape[0], down.in_width
        # across ranks the row projection's output may be its latent's shard (width r)
        fits = (
            gate_up.first.in_width == h
            and gate_up.out_width == 2 * inter
            and (world > 1 or down.out_width == h)
        )
        if not fits:
            return None
        norm = weights["post_norm.weight"].contiguous()
        return MlpHalf(decode_block_library(), model.norm.eps, norm, gate_up, inter, down)

    def mlp(
        self,
        x: torch.Tensor,
        summands: list[Summand],
        gather: Gather,
        after: tuple[torch.Tensor, Projection] | None = None,
    ) -> torch.Tensor:
        """x += summands (in place); the MLP half's output [m, down's columns] (unreduced).
        ``after`` = (the heads' output, o): x += its product with o too, in the same call
        where the half is one call (else through a call of its own)."""
        parts, pending = apart(summands)
        if pending is not None:
            if after is not None:
                raise ValueError("decode block: the heads' output beside a pending up product")
            after = pending.operands
        norm = (self.post_norm, self.eps)
        source, parts, norm, up, after = _input(
            self.library, x, parts, after, norm, self.gate_up, gather
        )
        return self.library.mlp(source, parts, norm, up, self.inter, self.down, after)


@dataclass(frozen=True)
class LatentAttentionHalf:
    """A latent-cache layer's attention projections on one rank, around its latent
    attention (``runtime.model.eager_attention.decode_latent_native``): in one native
    call x += summands, RMSNorm, then q beside the k|v latent (the cache's columns ``kv``
    of it) — q's matrix and the group's down factors (``q`` and ``qkv``), or, where q's
    latent comes first in the group's, the down factors side by side then q's up factor
    (``qkv``, ``q`` None) — and q rotated; then the heads' output times W_o (``o``: dense,
    or its factors), which ``MlpHalf.mlp`` multiplies in its call (``after``)."""

    library: DecodeBlockLibrary
    eps: float
    input_norm: torch.Tensor
    q: Projection | None
    qkv: Projection
    kv: tuple[int, int]  # the latent's k|v columns: (first, count)
    o: Projection
    rope: tuple[int, int]  # (head_dim, half): RoPE pairs as ``DecodeBlock.half``

    @staticmethod
    def of(
        model: ModelConfig, weights: dict[str, object], kv: tuple[int, int]
    ) -> LatentAttentionHalf | None:
        """The projections of a layer with these weights (packed) whose latent holds k|v
        at ``kv`` (q's dense matrix ``q.weight`` beside it, or q's rows first), or None
        where a matrix is not held as panels alone or the shapes do not fit."""
        cat, o = held_as_panels(weights, "attn.cat"), _projection(weights, "o", 1)
        dense_q, q_up = held_as_panels(weights, "q.weight"), held_as_panels(weights, "q.u")
        if cat is None or (dense_q or q_up) is None or not isinstance(o, Projection):
            return None
        h, (first, count) = weights["input_norm.weight"].shape[0], kv
        q_width = (dense_q or q_up).shape[1]
        fits = (
            cat.shape[0] == h
            and first + count <= cat.shape[1]
            and (dense_q is not None or q_up.shape[0] <= first)
            and (dense_q is None or dense_q.shape[0] == h)
            and q_width == o.in_width
            and o.out_width == h
        )
        if not fits:
            return None
        if dense_q is not None:
            q, qkv = Projection(dense_q.copy, q_width), Projection(cat.copy, cat.shape[1])
        else:
            q, qkv = None, Projection(cat.copy, cat.shape[1], ((q_up.copy, *q_up.shape),))
        norm = weights["input_norm.weight"].contiguous()
        rope = (model.head_dim, _rope_half(model))
        library = decode_block_library()
        return LatentAttentionHalf(library, model.norm.eps, norm, q, qkv, kv, o, rope)

    def project(
        self,
        x: torch.Tensor,
        summands: list[torch.Tensor],
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple:
        """x += summands (in place); (q [m, heads · d], the k|v latent [m, ·]); q rotated
        by ``rope_tables`` (cos, sin [m, 1, d]) in the same native call, or (None) not."""
        norm, rope = (self.input_norm, self.eps), None
        if rope_tables is not None:
            rope = (*rope_tables, *self.rope)
        q, latent = self.library.q_and_latent(x, summands, norm, self.q, self.qkv, rope)
        first, count = self.kv
        return q, latent[:, first : first + count]

    def attention(
        self,
        x: torch.Tensor,
        summands: list[torch.Tensor],
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        cache: LatentDecodeCache,
    ) -> torch.Tensor:
        """x += summands (in place); the heads' output [m, heads · d] before W_o:
        ``project`` (q rotated by ``rope_tables``) and the cache's native latent attention
        (``decode_latent_native``) in one native call, no Python between them."""
        scores, step = cache.scores, cache.step
        tables = scores.angles.tables(step.slots.shape[1], scores.layer.wpad)
        attention = LatentAttention(
            scores.library, scores.layer, step, cache.rows, tables, cache.scale
        )
        projections, rope = (self.q, self.qkv, self.kv[0]), (*rope_tables, *self.rope)
        norm = (self.input_norm, self.eps)
        return self.library.latent_attention(x, summands, norm, projections, rope, attention)


@dataclass(frozen=True)
class DecodeBlock:
    library: DecodeBlockLibrary
    heads: tuple[int, int, int]  # this rank's query heads, KV heads, head_dim
    eps: float
    half: int  # RoPE pairs: j with j + half (neox), or adjacent (0)
    input_norm: torch.Tensor
    qkv: ColumnProjection
    o: Projection  # whole, or across ranks its shard (Megatron's, or the down factor's)
    mlp_half: MlpHalf

    @staticmethod
    def of(model: ModelConfig, weights: dict[str, object], world: int = 1) -> DecodeBlock | None:
        """The block of a layer with these weights (by name, packed) on one of ``world``
        ranks, or None where a matrix is not held as panels alone or the shapes do not
        fit one another."""
        mlp = MlpHalf.of(model, weights, world)
        qkv, o = (_projection(weights, key, world) for key in ("qkv", "o"))
        if mlp is None or qkv is None or o is None:
            return None
        d, h = model.head_dim, weights["input_norm.weight"].shape[0]
        width = o.in_width
        heads = width // d
        kv_heads = (qkv.out_width - width) // (2 * d)
        fits = (
            width == heads * d
            and qkv.out_width == (heads + 2 * kv_heads) * d
            and kv_heads > 0
            and heads % kv_heads == 0
            and (world > 1 or o.out_width == h)
            and qkv.first.in_width == h
        )
        if not fits:
            return None
        half = _rope_half(model)
        norm = weights["input_norm.weight"].contiguous()
        return DecodeBlock(
            decode_block_library(), (heads, kv_heads, d), model.norm.eps, half, norm, qkv, o, mlp
        )

    def attention(
        self,
        x: torch.Tensor,
        summands: list[Summand],
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        cache: DenseDecodeCache,
        gather: Gather,
    ) -> torch.Tensor:
        """x += summands (in place); the attention half's output [m, o's columns]
        (unreduced). ``gather``: the ranks' all-gather of a latent's columns."""
        cos, sin = rope_tables  # [m, 1, d] each, contiguous
        operands = (cache.k_rows, cache.v_rows, cache.new_slots, cache.slots, cache.lengths)
        parts, pending = apart(summands)
        after = None if pending is None else pending.operands
        norm = (self.input_norm, self.eps)
        library = self.library
        source, parts, norm, qkv, after = _input(library, x, parts, after, norm, self.qkv, gather)
        if after is not None:  # the attention half's one call takes no such product
            parts = [*parts, pending.product()]
        return library.attention(
            source, parts, norm, qkv, self.heads, (cos, sin, self.half), operands, cache.scale,
            self.o,
        )  # fmt: skip

    def mlp(self, x: torch.Tensor, summands: list[Summand], gather: Gather) -> torch.Tensor:
        """x += summands (in place); the MLP half's output [m, down's columns] (unreduced)."""
        return self.mlp_half.mlp(x, summands, gather)
