"""The tensor-parallel model: vocab-parallel embedding, decoder layers of one mode,
final norm, vocab-parallel LM head with the logits gathered."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from dsl.plan import ModePlan
from dsl.spec import Spec
from runtime.dist.comm import Comm
from runtime.kernels import eager
from runtime.kernels.huge_pages import on_huge_pages
from runtime.model.decode_stack import DecodeStack
from runtime.model.execution import Batch, Execution
from runtime.model.layer_modes import layer_class
from runtime.model.layers import LayerSetup
from runtime.model.pending_up import summed
from runtime.model.rope import inv_freq
from runtime.model.weights import ModelWeights


class TPModel(nn.Module):
    """Same model, same runtime for every mode; only the layer modules differ."""

    def __init__(
        self,
        spec: Spec,
        mode_plan: ModePlan,
        rank: int,
        comm: Comm,
        execution: Execution,
        weights: ModelWeights,
        kv_cache: str = "latent",
    ) -> None:
        """``kv_cache``: the cache the runner asked for (dense | latent | auto); layers
        whose cache it makes latent hand attention the latent."""
        super().__init__()
        self.spec, self.comm, self.rank, self.execution = spec, comm, rank, execution
        m = spec.model
        freqs = inv_freq(m.positions, m.head_dim) if m.positions.kind == "rope" else None
        self.inv_freq = freqs
        self.register_buffer("embed", weights.embed, persistent=False)
        self.register_buffer("lm_head", weights.lm_head, persistent=False)
        self.positions_table = weights.positions
        self.final_norm = weights.final_norm
        layers = []
        for index, lp in enumerate(mode_plan.per_layer()):
            setup = LayerSetup(
                model=m,
                plan=lp,
                rank=rank,
                comm=comm,
                execution=execution,
                inv_freq=freqs,
                latent_cache=lp.cache_kind(kv_cache) == "latent",
            )
            layers.append(layer_class(lp)(setup, index, weights.layers[index]))
        self.layers = nn.ModuleList(layers)
        # Decided once: whether ``forward`` carries each layer's last product unreduced.
        self.fuses_residual = bool(layers) and all(layer.fuses_residual() for layer in layers)
        self.decode_stack: DecodeStack | None = None  # ``prepare_decode_blocks``

    def prepare_eager(self) -> None:
        """See ``DecoderLayer.prepare_eager`` (the LM head is already stored [out, in]; it
        moves to huge pages too, and a tied embedding with it)."""
        for layer in self.layers:
            layer.prepare_eager()
        head = on_huge_pages(self.lm_head)
        if self.embed.data_ptr() == self.lm_head.data_ptr() and self.embed.shape == head.shape:
            self.embed = head
        self.lm_head = head

    def decode_block_matrices(self) -> list[torch.Tensor]:
        """The layers' matrices that their native decode steps multiply as panels
        (``DecoderLayer.decode_block_matrices``): the tuned products hold them so."""
        return [t for layer in self.layers for t in layer.decode_block_matrices()]

    def prepare_decode_blocks(self) -> None:
        """After the tuned products have packed and released the matrices; on one rank,
        the layers' native halves as one call where every layer has them (``DecodeStack``)."""
        for layer in self.layers:
            layer.prepare_decode_block()
        if self.comm.world == 1:
            self.decode_stack = DecodeStack.of([layer.native_halves() for layer in self.layers])

    def matrices(self) -> list[torch.Tensor]:
        """Every matrix as the eager backend multiplies by it: b [in, out]."""
        mats = [t for layer in self.layers for t in layer.buffers() if t.dim() == 2]
        return [*mats, self.lm_head.t()]

    def release_matrices(self, stand_in: Callable[[torch.Tensor], object | None]) -> int:
        """Every layer's ``DecoderLayer.release`` (the LM head stays: the embedding may
        share it, and its products take a fresh view each step)."""
        return sum(layer.release(stand_in) for layer in self.layers)

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids in its vocabulary rows; an all-reduce sums them."""
        rows = self.embed.shape[0]
        local = input_ids.long() - self.rank * rows
        inside = (local >= 0) & (local < rows)
        x = self.embed[local.clamp(0, rows - 1)] * inside[:, None].to(self.embed.dtype)
        self.comm.all_reduce(x, tag="embed")
        if self.positions_table is not None:
            x = x + self.positions_table[positions.long() + self.spec.model.positions.offset]
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self.spec.model
        h = self.execution.norm(
            hidden, self.final_norm["weight"], self.final_norm.get("bias"), m.norm.kind
        )
        local = self.execution.matmul(h, self.lm_head.t())
        return self.comm.all_gather_columns(local, tag="logits")[:, : m.vocab_size]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        """Hidden states [T, h] of the tokens (call ``logits`` on the rows you need).
        The layers' ``forward`` is called directly: they have no hooks, and a decode step
        reaches its first product two calls sooner per module (docs/ARCHITECTURE.md)."""
        x = self.embed_tokens(input_ids, positions)
        # The loop stays in this function: a helper would put the first product one call
        # further from the step (tests/test_graph_safety.py).
        if self.comm.timed:
            waited, start = self.comm.stats.total_seconds(), time.perf_counter()
        if not self.fuses_residual:
            for layer in self.layers:
                x = layer.forward(x, batch)
        else:
            summands = None  # each layer's last product, as the next's first norm adds it
            stack = None if self.comm.count else self.decode_stack  # counts: layer by layer
            last = stack.run(x, batch) if stack is not None else None
            if last is not None:
                summands = [last]
            else:
                for layer in self.layers:
                    native = layer.decode_natively(x, summands, batch)
                    x, summands = native or layer.forward_fused(x, summands, batch)
            x = eager.add_summands(x, summed(summands))
        if self.comm.timed:
            self._record_own_time(x, start, waited)
        return x

    def _record_own_time(self, x: torch.Tensor, start: float, waited: float) -> None:
        """A breakdown's per-block compute: the layers' time on this rank less what their
        collectives and the waits before them took (recorded in between)."""
        if x.is_cuda:
            torch.cuda.synchronize()
        own = time.perf_counter() - start - (self.comm.stats.total_seconds() - waited)
        self.comm.stats.record("step:blocks", 0, own)
