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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.spec import ModelConfig
from runtime.kernels.cpu_gemm import ReleasedMatrix
from runtime.kernels.decode_block import DecodeBlockLibrary, Projection, decode_block_library
from runtime.kernels.panel import panel_library
from runtime.model.paged_cache import DenseDecodeCache

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


def matrices_of(weights: dict[str, object]) -> list[str] | None:
    """The names of the matrices the block multiplies, each projection dense or
    low-rank as ``weights`` (the layer's, by name) hold it; None where one is neither
    (a column group part merged, part low-rank)."""
    names: list[str] = []
    for dense, down, members in PROJECTIONS.values():
        if dense in weights:
            names.append(dense)
        elif down in weights and all(f"{n}.u" in weights for n in members):
            names += [down, *(f"{n}.u" for n in members)]
        else:
            return None
    return names


def covers(model: ModelConfig, weights: dict[str, object]) -> bool:
    """Whether the decode block computes a layer of ``model`` with these weights (by
    name as ``DecoderLayer.w`` has them; before or after packing)."""
    plain = (
        model.norm.kind == "rms"
        and model.mlp.kind == "glu"
        and model.mlp.activation == "silu"
        and not model.qk_norm
        and model.positions.kind == "rope"
        and model.positions.style in ("neox", "gptj")
    )
    names = matrices_of(weights)
    biases = any(name.endswith(".bias") for name in weights)
    fp32 = names is not None and all(
        getattr(weights[name], "dtype", None) == torch.float32
        for name in (*names, "input_norm.weight", "post_norm.weight")
    )
    built = decode_block_library() is not None and panel_library() is not None
    return plain and not biases and fp32 and built


def _panels(weights: dict[str, object], name: str) -> ReleasedMatrix | None:
    m = weights.get(name)
    return m if isinstance(m, ReleasedMatrix) and m.form.kind == "panel" else None


def _projection(weights: dict[str, object], key: str) -> Projection | None:
    """The projection ``key`` of ``PROJECTIONS`` as panels, or None where a matrix is not
    held as panels alone (the tuned products chose another form)."""
    dense, down, members = PROJECTIONS[key]
    if dense in weights:
        m = _panels(weights, dense)
        return None if m is None else Projection(m.copy, m.shape[1])
    held = [_panels(weights, name) for name in (down, *(f"{n}.u" for n in members))]
    if any(m is None for m in held):
        return None
    first, *ups = held
    if first.shape[1] != sum(u.shape[0] for u in ups):
        return None
    return Projection(first.copy, first.shape[1], tuple((u.copy, *u.shape) for u in ups))


@dataclass(frozen=True)
class DecodeBlock:
    library: DecodeBlockLibrary
    heads: tuple[int, int, int]  # this rank's query heads, KV heads, head_dim
    inter: int  # this rank's MLP columns
    eps: float
    half: int  # RoPE pairs: j with j + half (neox), or adjacent (0)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: tuple[Projection, Projection, Projection, Projection]  # as PROJECTIONS

    @staticmethod
    def of(model: ModelConfig, weights: dict[str, object]) -> DecodeBlock | None:
        """The block of a layer with these weights (by name, packed), or None where a
        matrix is not held as panels alone or the shapes do not fit one another."""
        projections = {key: _projection(weights, key) for key in PROJECTIONS}
        if any(p is None for p in projections.values()):
            return None
        qkv, o, gate_up, down = (projections[k] for k in PROJECTIONS)
        d, h = model.head_dim, weights["input_norm.weight"].shape[0]
        width, inter = o.in_width, down.in_width
        heads = width // d
        kv_heads = (qkv.out_width - width) // (2 * d)
        fits = (
            width == heads * d
            and qkv.out_width == (heads + 2 * kv_heads) * d
            and kv_heads > 0
            and heads % kv_heads == 0
            and o.out_width == h == down.out_width == qkv.in_width == gate_up.in_width
            and gate_up.out_width == 2 * inter
        )
        if not fits:
            return None
        half = d // 2 if model.positions.style == "neox" else 0
        norms = weights["input_norm.weight"], weights["post_norm.weight"]
        return DecodeBlock(
            decode_block_library(), (heads, kv_heads, d), inter, model.norm.eps, half,
            norms[0].contiguous(), norms[1].contiguous(), (qkv, o, gate_up, down),
        )  # fmt: skip

    def attention(
        self,
        x: torch.Tensor,
        summands: list[torch.Tensor],
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        cache: DenseDecodeCache,
    ) -> torch.Tensor:
        """x += summands (in place); the attention half's output [m, h] (unreduced)."""
        cos, sin = rope_tables  # [m, 1, d] each, contiguous
        operands = (cache.k_rows, cache.v_rows, cache.new_slots, cache.slots, cache.lengths)
        qkv, o, _, _ = self.projections
        return self.library.attention(
            x, summands, (self.input_norm, self.eps), qkv, self.heads, (cos, sin, self.half),
            operands, cache.scale, o,
        )  # fmt: skip

    def mlp(self, x: torch.Tensor, summands: list[torch.Tensor]) -> torch.Tensor:
        """x += summands (in place); the MLP half's output [m, h] (unreduced)."""
        _, _, gate_up, down = self.projections
        return self.library.mlp(x, summands, (self.post_norm, self.eps), gate_up, self.inter, down)
