"""A dense layer's decode step as two native calls (``runtime.kernels.decode_block``):
the attention half and the MLP half, each ending in its row product not yet reduced (the
Megatron layer's pending summand). Made once per layer that it covers, after the tuned
products have packed the layer's four matrices as panels (``DecodeBlock.of``); the layer
uses it for decode steps whose batch offers the layer's dense cache, and its own ops
otherwise (prefill, latent caches, a library that did not build).

It covers the Llama-like layer: RMSNorm without bias, q|k|v and gate|up fused into one
matrix each (``DecoderLayer.FUSED``), no biases or q/k norms, RoPE, a SiLU GLU, fp32 on
the CPU. At batch 1 on the Intel Xeon VM the products took 18 of a 28 ms step of the
135M model and the ops between them the rest (``native/decode_block.c``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.spec import ModelConfig
from runtime.kernels.cpu_gemm import ReleasedMatrix
from runtime.kernels.decode_block import DecodeBlockLibrary, decode_block_library
from runtime.kernels.panel import panel_library
from runtime.model.paged_cache import DenseDecodeCache

# the layer's matrices, fused as ``DecoderLayer.fuse_dense_groups`` makes them
MATRICES = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight")


def covers(model: ModelConfig, weights: dict[str, object]) -> bool:
    """Whether the decode block computes a layer of ``model`` with these weights
    (names as ``DecoderLayer.w`` has them, fused groups joined; before packing)."""
    plain = (
        model.norm.kind == "rms"
        and model.mlp.kind == "glu"
        and model.mlp.activation == "silu"
        and not model.qk_norm
        and model.positions.kind == "rope"
        and model.positions.style in ("neox", "gptj")
    )
    biases = any(name.endswith(".bias") for name in weights)
    fp32 = all(
        getattr(weights.get(name), "dtype", None) == torch.float32
        for name in (*MATRICES, "input_norm.weight", "post_norm.weight")
    )
    built = decode_block_library() is not None and panel_library() is not None
    return plain and not biases and fp32 and built


@dataclass(frozen=True)
class DecodeBlock:
    library: DecodeBlockLibrary
    heads: tuple[int, int, int]  # this rank's query heads, KV heads, head_dim
    inter: int  # this rank's MLP columns
    eps: float
    half: int  # RoPE pairs: j with j + half (neox), or adjacent (0)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # as MATRICES

    @staticmethod
    def of(model: ModelConfig, weight) -> DecodeBlock | None:
        """The block of a layer whose weights ``weight(name)`` gives, or None where a
        matrix is not held as panels alone (the tuned products chose another form) or
        the shapes do not fit one another."""
        held = [weight(name) for name in MATRICES]
        if not all(isinstance(m, ReleasedMatrix) and m.form.kind == "panel" for m in held):
            return None
        qkv, o, gate_up, down = held
        d = model.head_dim
        width, inter = o.shape[0], down.shape[0]
        heads = width // d
        kv_heads = (qkv.shape[1] - width) // (2 * d)
        h = qkv.shape[0]
        fits = (
            width == heads * d
            and qkv.shape[1] == (heads + 2 * kv_heads) * d
            and kv_heads > 0
            and heads % kv_heads == 0
            and o.shape[1] == h == down.shape[1] == gate_up.shape[0]
            and gate_up.shape[1] == 2 * inter
        )
        if not fits:
            return None
        half = d // 2 if model.positions.style == "neox" else 0
        norms = weight("input_norm.weight"), weight("post_norm.weight")
        panels = tuple(m.copy for m in held)
        return DecodeBlock(
            decode_block_library(), (heads, kv_heads, d), inter, model.norm.eps, half,
            norms[0].contiguous(), norms[1].contiguous(), panels,
        )  # fmt: skip

    def attention(
        self,
        x: torch.Tensor,
        summands: list[torch.Tensor],
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        cache: DenseDecodeCache,
    ) -> torch.Tensor:
        """x += summands (in place); the attention half's output [m, h] (unreduced)."""
        cos, sin = (t.reshape(t.shape[0], -1) for t in rope_tables)
        operands = (cache.k_rows, cache.v_rows, cache.new_slots, cache.slots, cache.lengths)
        qkv, o, _, _ = self.panels
        return self.library.attention(
            x, summands, (self.input_norm, self.eps), qkv, self.heads,
            (cos.contiguous(), sin.contiguous(), self.half), operands, cache.scale, o,
        )  # fmt: skip

    def mlp(self, x: torch.Tensor, summands: list[torch.Tensor]) -> torch.Tensor:
        """x += summands (in place); the MLP half's output [m, h] (unreduced)."""
        _, _, gate_up, down = self.panels
        return self.library.mlp(x, summands, (self.post_norm, self.eps), gate_up, self.inter, down)
