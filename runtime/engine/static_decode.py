"""The static decode path (GPU): fixed buffers per batch-size bucket, every count in
device memory, no host synchronisation, so that a CUDA graph can capture and replay the
step (docs/METHOD.md: "Latent decode that a CUDA graph can replay")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.engine.kv_cache import plan_compaction
from runtime.kernels.reference import apply_norm
from runtime.model.paged_cache import LayerCache
from runtime.model.transformer import TPModel


@dataclass(frozen=True)
class StaticShapes:
    rows: int  # the most rows a step can hold (largest bucket)
    max_blocks: int  # block-table width: max_seq_len / block_size
    block_size: int
    num_blocks: int  # pool size (the scratch block is number num_blocks)
    buckets: tuple[int, ...]


class StaticDecoder:
    """Buffers, host-side preparation, the graph-safe step and graph capture."""

    def __init__(
        self,
        model: TPModel,
        caches: list[LayerCache],
        latent_widths: list[int],
        shapes: StaticShapes,
    ) -> None:
        self.model, self.caches, self.shapes = model, caches, shapes
        # the static path's kernels: Triton's, or their torch references
        self.kernels, self.backend = model.execution.kernels, model.execution.backend
        self.latent_widths = latent_widths
        self.scratch_slot = shapes.num_blocks * shapes.block_size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._buffers(model.embed.dtype, model.embed.device)

    def _buffers(self, dtype: torch.dtype, dev: torch.device) -> None:
        s = self.shapes
        i32 = {"dtype": torch.int32, "device": dev}
        self.input_ids = torch.zeros(s.rows, **i32)
        self.positions = torch.zeros(s.rows, **i32)
        self.slots = torch.zeros(s.rows, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(s.rows, s.max_blocks, **i32)
        self.seq_lens = torch.zeros(s.rows, **i32)
        self.n_tokens = torch.zeros(1, **i32)
        if not self.latent_widths:
            return
        # Compact buffer: at most one compact block per pool block (a batch never holds
        # more distinct blocks than the pool), and at most rows · max_blocks.
        self.max_compact = min(s.rows * s.max_blocks, s.num_blocks + 1)
        self.copy_list = torch.zeros(self.max_compact, 3, **i32)
        self.num_runs = torch.zeros(1, **i32)
        self.remap = torch.zeros(s.rows, s.max_blocks, **i32)
        self.compact_positions = torch.zeros(self.max_compact * s.block_size, **i32)
        self.n_rows = torch.zeros(1, **i32)
        self.compact = {
            w: torch.zeros(self.max_compact, s.block_size, w, dtype=dtype, device=dev)
            for w in self.latent_widths
        }
        lps = [layer.s.plan for layer in self.model.layers]
        kv_width = max(lp.kv_dense_per_rank // 2 for lp in lps)
        self.k_rows = torch.zeros(
            self.max_compact * s.block_size, kv_width, dtype=dtype, device=dev
        )
        self.v_rows = torch.zeros_like(self.k_rows)

    def bucket_for(self, batch: int) -> int:
        """The smallest graph bucket that holds the batch; above the largest, the batch."""
        return next((b for b in self.shapes.buckets if b >= batch), batch)

    def decode(self, seqs, slot_of: Callable[[list[int], int], int]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step."""
        batch = len(seqs)
        bucket = self.bucket_for(batch)
        if bucket > self.shapes.rows:
            raise ValueError(f"decode batch {batch} exceeds max_batch_size {self.shapes.rows}")
        self.prepare(seqs, bucket, slot_of)
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self.step(bucket)
        return logits[:batch]

    def prepare(self, seqs, bucket: int, slot_of: Callable[[list[int], int], int]) -> None:
        """Host side: fill the static buffers (padded rows write to the scratch block and
        attend to nothing) and, for latent layers, the compaction plan."""
        batch, s = len(seqs), self.shapes
        pad = bucket - batch
        ids = [q.tokens[-1] for q in seqs] + [0] * pad
        pos = [q.length - 1 for q in seqs] + [0] * pad
        slots = [slot_of(q.block_table, q.length - 1) for q in seqs] + [self.scratch_slot] * pad
        tables = torch.zeros(bucket, s.max_blocks, dtype=torch.int32)
        for b, q in enumerate(seqs):
            tables[b, : len(q.block_table)] = torch.tensor(q.block_table, dtype=torch.int32)
        lens = [q.length for q in seqs] + [0] * pad
        self.input_ids[:bucket].copy_(torch.tensor(ids, dtype=torch.int32))
        self.positions[:bucket].copy_(torch.tensor(pos, dtype=torch.int32))
        self.slots[:bucket].copy_(torch.tensor(slots, dtype=torch.long))
        self.block_tables[:bucket].copy_(tables)
        self.seq_lens[:bucket].copy_(torch.tensor(lens, dtype=torch.int32))
        self.n_tokens.fill_(batch)
        if self.latent_widths:
            plan = plan_compaction(
                [q.block_table for q in seqs],
                [q.length for q in seqs],
                s.block_size,
                s.max_blocks,
                self.max_compact,
                bucket,
            )
            self.copy_list.copy_(plan.copy_list)
            self.num_runs.copy_(plan.num_runs)
            self.remap[:bucket].copy_(plan.remap)
            self.compact_positions.copy_(plan.positions)
            self.n_rows.copy_(plan.n_rows)

    def step(self, bucket: int) -> torch.Tensor:
        """The graph-safe step: fixed shapes for a bucket, every count read from device
        memory, no host synchronisation."""
        positions = self.positions[:bucket]
        attention = self._attention(bucket)
        batch = self.model.execution.batch(positions, self.n_tokens, attention, None)
        hidden = self.model.forward(self.input_ids[:bucket], positions, batch)
        return self.model.logits(hidden)

    def _attention(self, bucket: int):
        registry = self.kernels

        def attention(index, q, k, v, latent):
            cache = self.caches[index]
            cache.write(self.slots[:bucket], k, v, latent)
            out = torch.empty_like(q)
            kernel = registry.get("paged_attention", (q.shape[1], k.shape[1]), self.backend)
            if cache.kind == "dense":
                tables, k_cache, v_cache = self.block_tables[:bucket], cache.k, cache.v
            else:
                tables = self.remap[:bucket]
                k_cache, v_cache = self._reconstruct(index, k.shape[1])
            return kernel(q, k_cache, v_cache, tables, self.seq_lens[:bucket], out)

        return attention

    def _reconstruct(self, index: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the batch's latent blocks into the compact buffer, rebuild K and V with the
        fixed-size GEMM (cost follows the valid rows), q/k norm and RoPE K in place."""
        layer, cache = self.model.layers[index], self.caches[index]
        lp, registry, backend = layer.s.plan, self.kernels, self.backend
        width, r_k = lp.kv_latent_per_rank, lp.shape.rank("k")
        d = layer.s.model.head_dim
        compact = self.compact[width]
        registry.get("kv_copy", width, backend)(
            cache.latent, compact, self.copy_list, self.num_runs
        )
        rows = compact.view(-1, width)
        k_rows = self.k_rows[:, : kv_heads * d]
        v_rows = self.v_rows[:, : kv_heads * d]
        for out, name, part in ((k_rows, "k", rows[:, :r_k]), (v_rows, "v", rows[:, r_k:])):
            u = layer.w(f"{name}.u")
            registry.get("gemm", tuple(u.shape), backend)(part, u, out, self.n_rows)
            bias = layer.w(f"{name}.bias")
            if bias is not None:
                out.add_(bias)
        keys = k_rows.view(-1, kv_heads, d)
        if layer.s.model.qk_norm:
            eps = layer.s.model.norm.eps
            normed = apply_norm(keys, layer.w("k_norm.weight"), None, norm="rms", eps=eps)
            keys.copy_(normed.to(keys.dtype))
        if layer.s.inv_freq is not None:
            registry.get("rope", kv_heads, backend)(
                keys, self.compact_positions, layer.s.inv_freq, self.n_rows
            )
        shape = (self.max_compact, self.shapes.block_size, kv_heads, d)
        return keys.view(shape), v_rows.view(shape)

    def capture_graphs(self, comm) -> None:
        """CUDA graphs per batch-size bucket (GPU only); inside graphs the ring
        all-gather becomes one all-gather (the setting is restored afterwards)."""
        overlap, comm.overlap = comm.overlap, False
        self.slots.fill_(self.scratch_slot)  # warm-up and capture write to the scratch block
        pool = None
        try:
            for bucket in reversed(self.shapes.buckets):
                self.n_tokens.fill_(bucket)
                self.step(bucket)  # warm up: compile kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.step(bucket)
                pool = graph.pool()
                self.graphs[bucket] = (graph, logits)
            torch.cuda.synchronize()
        finally:
            comm.overlap = overlap
