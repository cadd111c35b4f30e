"""The decoder layer's shared parts (each mode's layer: ``runtime.model.deinfer_layers``,
``runtime.model.megatron_layers``), in the order of docs/METHOD.md.

The dataflow does not depend on the spec, so it is written once per mode; its products,
norms and RoPE come from the rank's ``Execution`` (``runtime.model.execution``: the
generated kernels on the static path, the eager products on the dynamic one), picked by
the shapes the plan gives. Attention is the forward's ``Batch.attention``: prefill,
paged decode and the latent-cache reconstruction live with the cache that the runner
owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dsl.plan import LayerPlan
from dsl.spec import ModelConfig
from runtime.dist.comm import Comm
from runtime.kernels import eager
from runtime.kernels.cpu_gemm import ReleasedMatrix
from runtime.kernels.huge_pages import on_huge_pages
from runtime.model.decode_block import (
    MLP_PROJECTIONS,
    PROJECTIONS,
    DecodeBlock,
    LatentAttentionHalf,
    MlpHalf,
    covers,
    matrices_of,
)
from runtime.model.execution import Batch, Execution
from runtime.model.paged_cache import DenseDecodeCache, LatentDecodeCache
from runtime.model.pending_up import summed

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class LayerSetup:
    model: ModelConfig
    plan: LayerPlan
    rank: int
    comm: Comm
    execution: Execution  # the rank's products, norms and RoPE (one for every layer)
    inv_freq: torch.Tensor | None  # None for learned positions
    # Whether this layer's KV cache is latent (``LayerPlan.cache_kind``): only then does
    # attention get the gathered latent's k/v columns.
    latent_cache: bool = True


class DecoderLayer(nn.Module):
    """Shared parts: weights by plan name, norms, GEMMs, RoPE, q/k norm."""

    def __init__(self, setup: LayerSetup, index: int, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.s = setup
        self.index = index
        for name, tensor in weights.items():
            self.register_buffer(name.replace(".", "__"), tensor, persistent=False)
        self.names = frozenset(weights)

    def prepare_eager(self) -> None:
        """Once, for the eager backend: keep every matrix's [in, out] view but store it as
        [out, in], which oneDNN's linear reads fastest (``runtime.kernels.eager.matmul``),
        on huge pages (each is streamed once per step: ``runtime.kernels.huge_pages``)."""
        for name in self.names:
            t = self.w(name)
            if t.dim() == 2:
                setattr(self, name.replace(".", "__"), on_huge_pages(t.t()).t())
        self.fuse_columns()

    def fuse_columns(self) -> None:
        """Modes whose column projections share an input multiply them as one GEMM."""

    # the native decode step, once the layer's matrices are panels (``prepare_decode_block``);
    # a latent-cache layer's: the MLP half alone
    decode_block: DecodeBlock | None = None
    mlp_half: MlpHalf | None = None
    latent_half: LatentAttentionHalf | None = None  # and its attention's projections

    def decode_block_allowed(self) -> bool:
        """Whether this layer's dataflow is the native decode block's (two half-blocks,
        each ending in a product the next norm adds after its all-reduce)."""
        return False

    def decode_block_names(self) -> list[str]:
        """The names of the matrices to hold as panels alone, where the native decode
        block covers this layer on this rank's path (``runtime.model.decode_block.covers``):
        all of them where its cache is dense (the block attends over K and V rows), the
        MLP's where it holds latents (the MLP half alone)."""
        weights = {name: self.w(name) for name in self.names}
        allowed = self.decode_block_allowed() and self.s.execution.fuses_residual_adds
        across = self.s.comm.world > 1
        keys = MLP_PROJECTIONS if self.s.latent_cache else tuple(PROJECTIONS)
        if not (allowed and covers(self.s.model, weights, across, keys)):
            return []
        names = matrices_of(weights, across, keys) or []
        return names and names + self.latent_attention_names()

    def latent_attention_names(self) -> list[str]:
        """The matrices of a latent-cache layer's attention that ``LatentAttentionHalf``
        multiplies (none: its attention runs op by op)."""
        return []

    def latent_attention_half(self, weights: dict[str, object]) -> LatentAttentionHalf | None:
        """The native projections of a latent-cache layer's attention, where it has them."""
        return None

    def decode_block_matrices(self) -> list[torch.Tensor]:
        """The matrices of ``decode_block_names``."""
        return [self.w(name) for name in self.decode_block_names()]

    def prepare_decode_block(self) -> None:
        """Once the tuned products have packed and released the matrices."""
        if self.decode_block_names():
            weights = {name: self.w(name) for name in self.names}
            if self.s.latent_cache:
                self.mlp_half = MlpHalf.of(self.s.model, weights, self.s.comm.world)
                self.latent_half = self.latent_attention_half(weights)
            else:
                self.decode_block = DecodeBlock.of(self.s.model, weights, self.s.comm.world)

    def native_halves(self) -> DecodeBlock | tuple[LatentAttentionHalf, MlpHalf] | None:
        """This layer's decode step as native halves alone (``DecodeStack`` runs them): its
        decode block, or a latent cache's attention half and MLP half; else None."""
        if self.decode_block is not None:
            return self.decode_block
        if self.latent_half is not None and self.mlp_half is not None:
            return self.latent_half, self.mlp_half
        return None

    def decode_natively(
        self, x: torch.Tensor, summands: list[torch.Tensor] | None, batch: Batch
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """``forward_fused`` through the native decode block, where the layer has one and
        the batch is a decode step that offers this layer's dense cache, or (a latent
        cache) through the MLP half after the attention: ``latent_heads`` (W_o then in the
        MLP half's call), or op by op; else None."""
        gather = self.s.comm.all_gather_columns
        if self.mlp_half is not None and batch.decode:
            if self.latent_half is not None:
                heads = self.latent_heads(x, summands or [], batch)
                # o's product runs in the MLP half's call; its output has x's shape (what
                # a rank alone counts as the collective it skipped)
                self.row_summands("o", x, batch)
                down = self.mlp_half.mlp(x, [], gather, (heads, self.latent_half.o))
            else:  # the attention op by op
                if summands:
                    eager.add_summands(x, summed(summands))
                down = self.mlp_half.mlp(x, [self.attention_block(x, batch)], gather)
            return x, self.row_summands("down", down, batch)
        if self.decode_block is None or batch.decode_cache is None or batch.rope_tables is None:
            return None
        cache = batch.decode_cache(self.index)
        if not isinstance(cache, DenseDecodeCache):
            return None
        block = self.decode_block
        o = block.attention(x, summands or [], batch.rope_tables, cache, gather)
        down = block.mlp(x, self.row_summands("o", o, batch), gather)
        return x, self.row_summands("down", down, batch)

    def latent_heads(
        self, x: torch.Tensor, summands: list[torch.Tensor], batch: Batch
    ) -> torch.Tensor:
        """x += summands (in place); a latent-cache layer's attention heads' output [m,
        heads · d] before W_o, through ``latent_half``: its projections, which rotate q
        too, and the cache's native latent attention in one native call; or, where the
        cache is not read natively, the projections' call, then the step's attention."""
        rows, d = x.shape[0], self.s.model.head_dim
        tables = batch.rope_tables  # the dynamic path's: q rotated in the projections' call
        cache = None
        if tables is not None and batch.decode_cache is not None:
            cache = batch.decode_cache(self.index)
        if isinstance(cache, LatentDecodeCache):
            return self.latent_half.attention(x, summands, tables, cache)
        q, latent = self.latent_half.project(x, summands, tables)
        q = q.view(rows, -1, d)
        if tables is None:
            q = self.s.execution.rope(q, batch, self.s.inv_freq)
        return batch.attention(self.index, q, None, None, latent).reshape(rows, -1)

    def row_summands(self, name: str, pending: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        """What the next norm adds for the native block's row projection ``name``'s
        output (``summands_of``; deinfer's may be a latent to reduce and multiply up)."""
        return self.summands_of(pending)

    # Column projections that read the same input, multiplied as one GEMM once
    # ``fuse_dense_groups`` has concatenated their weights (the eager backend does: at 16
    # rows it saved 5% of the GEMM time of the 135M model here, and 20% at one row).
    FUSED: ClassVar[dict[tuple[str, ...], str]] = {
        ("q", "k", "v"): "qkv",
        ("gate", "up"): "gate_up",
    }

    def fuse_dense_groups(self) -> None:
        """Each ``FUSED`` group whose members are all column-split dense weights (in
        deinfer: all merged) becomes one weight [in, sum of outs]."""
        for names, fused in self.FUSED.items():
            if all(self.w(f"{n}.weight") is not None for n in names):
                parts = [self.w(f"{n}.weight") for n in names]
                joined = on_huge_pages(torch.cat([p.t() for p in parts])).t()  # [out, in]
                for n in names:
                    delattr(self, f"{n}__weight")
                self.register_buffer(f"{fused}__weight", joined, persistent=False)
                self.names = (self.names - {f"{n}.weight" for n in names}) | {f"{fused}.weight"}
                self.widths = {**getattr(self, "widths", {}), fused: [p.shape[1] for p in parts]}

    def dense_columns(self, names: tuple[str, ...], x: torch.Tensor, batch: Batch) -> list:
        """The products x·W of the dense weights ``names`` (one GEMM where fused)."""
        fused = self.FUSED.get(names)
        if fused is not None and self.w(f"{fused}.weight") is not None:
            y = self.gemm(x, self.w(f"{fused}.weight"), batch.n_valid)
            return list(y.split(self.widths[fused], dim=1))
        return [self.gemm(x, self.w(f"{n}.weight"), batch.n_valid) for n in names]

    def gemm_only(self) -> set[str]:
        """Names of the matrices the eager backend reads only whole, through ``gemm``:
        the ones a tuned gemm may keep in its own layout alone (``release``)."""
        return {name for name in self.names if self.w(name).dim() == 2}

    def release(self, stand_in: Callable[[torch.Tensor], object | None]) -> int:
        """Replace each ``gemm_only`` matrix for which ``stand_in`` gives a stand-in
        (``CpuGemm.release``): the buffer goes, its memory with it, and the stand-in is
        what ``w`` returns from now on. Returns how many were replaced."""
        count = 0
        for name in sorted(self.gemm_only()):
            replacement = stand_in(self.w(name))
            if replacement is not None:
                attribute = name.replace(".", "__")
                delattr(self, attribute)  # the buffer
                setattr(self, attribute, replacement)  # a plain attribute
                count += 1
        return count

    def w(self, name: str) -> torch.Tensor | ReleasedMatrix | None:
        """The weight ``name`` (a ``ReleasedMatrix`` once the tuned gemm keeps it alone)."""
        return getattr(self, name.replace(".", "__")) if name in self.names else None

    def norm(self, x: torch.Tensor, which: str) -> torch.Tensor:
        kind = self.s.model.norm.kind
        return self.s.execution.norm(x, self.w(f"{which}.weight"), self.w(f"{which}.bias"), kind)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        return self.s.execution.gemm(a, b, n_valid)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Qwen3: RMSNorm over each head's vector, before RoPE (k None: q's alone)."""
        if not self.s.model.qk_norm:
            return q, k
        q = self.s.execution.norm(q, self.w("q_norm.weight"), None, "rms")
        if k is not None:
            k = self.s.execution.norm(k, self.w("k_norm.weight"), None, "rms")
        return q, k

    def add_bias(self, y: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w(f"{name}.bias")
        return y if bias is None else y + bias.to(y.dtype)

    def attend(self, q, k, v, latent, batch: Batch) -> torch.Tensor:
        """k and v None: a latent-cache layer's decode, which attends from the cache."""
        d = self.s.model.head_dim
        tokens = q.shape[0]
        q = q.reshape(tokens, -1, d)
        if k is not None:
            k, v = k.reshape(tokens, -1, d), v.reshape(tokens, -1, d)
        q, k = self.qk_norm(q, k)
        rope, inv_freq = self.s.execution.rope, self.s.inv_freq
        q, k = rope(q, batch, inv_freq), None if k is None else rope(k, batch, inv_freq)
        return batch.attention(self.index, q, k, v, latent).reshape(tokens, -1)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = x + self.attention_block(x, batch)
        return x + self.mlp_block(x, batch)

    def fuses_residual(self) -> bool:
        """Whether this layer has ``forward_fused`` (``TPModel.forward`` uses it when
        every layer has)."""
        return False

    def forward_fused(
        self, x: torch.Tensor, summands: list[torch.Tensor] | None, batch: Batch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` with the residual adds fused into the norms after them: x plus
        the previous layer's ``summands`` (None before the first layer), in place, and
        what the next norm adds for this layer's last product (``summands_of`` it; op by
        op; ``decode_natively`` is the same through the native block)."""
        raise NotImplementedError(type(self).__name__)

    def summands_of(self, pending: torch.Tensor) -> list[torch.Tensor]:
        """What the next norm adds for this layer's pending product: its all-reduce's
        summands (a Megatron row product is partial on each rank)."""
        return self.s.comm.summands(pending)

    def add_norm(
        self, x: torch.Tensor, summands: list[torch.Tensor] | None, which: str
    ) -> torch.Tensor:
        """x += summands (in place), and the norm ``which`` of it."""
        if summands is None:
            return self.norm(x, which)
        return eager.add_and_normalize(
            x,
            summands,
            self.w(f"{which}.weight"),
            self.w(f"{which}.bias"),
            norm=self.s.model.norm.kind,
            eps=self.s.model.norm.eps,
        )
