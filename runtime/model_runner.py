"""One rank's model runner: weights, paged KV cache, prefill and a decode step that
only touches fixed buffers (captured as CUDA graphs per batch-size bucket on a GPU,
run eagerly on a CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl import build_plan, parse_spec
from runtime.attention import packed_causal_attention
from runtime.comm import Comm
from runtime.generated import load_generated
from runtime.kv_cache import LayerCache, allocate, layer_cache_kind, plan_compaction
from runtime.layers import Batch
from runtime.model import TPModel
from runtime.reference import apply_norm
from runtime.sampling import make_generator, sample_row
from runtime.sequence import SamplingParams
from runtime.weights import load_rank_weights

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerConfig:
    spec_text: str  # with parallel.tp equal to the group's size
    generated: str  # generated folder for that spec
    checkpoint: str
    mode: str
    backend: str  # "triton" | "torch"
    kv_cache: str  # dense | latent | auto
    num_blocks: int
    cuda_graphs: bool = True
    comm_stats: str = "off"  # off | count | timed (timed syncs the GPU around collectives)
    overlap: bool = True  # ring all-gather overlapped with the up-projection


@dataclass(frozen=True)
class SeqInput:
    """What a rank needs of one sequence for one step."""

    id: int
    tokens: list[int]  # all tokens for prefill; the last one for decode
    length: int  # tokens in the sequence, the one being processed included
    block_table: list[int]
    params: SamplingParams


class ModelRunner:
    def __init__(self, rank: int, world: int, config: RunnerConfig) -> None:
        self.rank, self.config = rank, config
        spec = parse_spec(config.spec_text)
        self.spec = spec
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        dtype = DTYPES[spec.runtime.dtype]
        mode_plan = build_plan(spec, tp=world).modes[config.mode]
        self.registry = load_generated(config.generated).KERNELS
        self.comm = Comm(count=config.comm_stats != "off", timed=config.comm_stats == "timed")
        self.comm.overlap = config.overlap
        weights = load_rank_weights(config.checkpoint, spec, mode_plan, rank, dtype)
        self.model = TPModel(
            spec, mode_plan, rank, self.comm, self.registry, config.backend, weights
        ).to(self.device)
        self.layer_plans = [mode_plan.layer_plan(r) for r in spec.decomposition.layers]
        self.kinds = [layer_cache_kind(lp, config.kv_cache) for lp in self.layer_plans]
        rt, m = spec.runtime, spec.model
        self.block_size = rt.block_size
        self.caches: list[LayerCache] = allocate(
            self.layer_plans,
            self.kinds,
            config.num_blocks,
            rt.block_size,
            m.head_dim,
            dtype,
            self.device,
        )
        self.scratch_slot = config.num_blocks * rt.block_size  # the extra last block
        self.max_blocks = -(-rt.max_seq_len // rt.block_size)
        self.buckets = sorted(rt.cuda_graph_batch_sizes) or [rt.max_batch_size]
        self.max_rows = max(rt.max_batch_size, self.buckets[-1])
        self.generators: dict[int, torch.Generator] = {}
        self._static_buffers(dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if config.cuda_graphs and self.device.type == "cuda":
            self.capture_graphs()

    # --- buffers -------------------------------------------------------------------

    def _static_buffers(self, dtype: torch.dtype) -> None:
        rows, dev = self.max_rows, self.device
        i32 = {"dtype": torch.int32, "device": dev}
        self.input_ids = torch.zeros(rows, **i32)
        self.positions = torch.zeros(rows, **i32)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(rows, self.max_blocks, **i32)
        self.seq_lens = torch.zeros(rows, **i32)
        self.n_tokens = torch.zeros(1, **i32)
        self.latent_widths = sorted(
            {
                lp.kv_latent_per_rank
                for lp, kind in zip(self.layer_plans, self.kinds, strict=True)
                if kind == "latent"
            }
        )
        if not self.latent_widths:
            return
        # Compact buffer: at most one compact block per pool block (a batch never holds
        # more distinct blocks than the pool), and at most rows · max_blocks.
        self.max_compact = min(rows * self.max_blocks, self.config.num_blocks + 1)
        self.copy_list = torch.zeros(self.max_compact, 3, **i32)
        self.num_runs = torch.zeros(1, **i32)
        self.remap = torch.zeros(rows, self.max_blocks, **i32)
        self.compact_positions = torch.zeros(self.max_compact * self.block_size, **i32)
        self.n_rows = torch.zeros(1, **i32)
        self.compact = {
            w: torch.zeros(self.max_compact, self.block_size, w, dtype=dtype, device=dev)
            for w in self.latent_widths
        }
        kv_width = max(lp.kv_dense_per_rank // 2 for lp in self.layer_plans)
        self.k_rows = torch.zeros(
            self.max_compact * self.block_size, kv_width, dtype=dtype, device=dev
        )
        self.v_rows = torch.zeros_like(self.k_rows)

    # --- prefill ---------------------------------------------------------------------

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqInput]) -> list[int]:
        ids, positions, slots, cu = [], [], [], [0]
        for s in seqs:
            ids += s.tokens
            positions += list(range(s.length))
            slots += [self._slot(s.block_table, p) for p in range(s.length)]
            cu.append(cu[-1] + s.length)
        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        causal = packed_causal_attention(cu)

        def attention(index, q, k, v, latent):
            self.caches[index].write(slot_t, k, v, latent)
            return causal(index, q, k, v, latent)

        pos_t = torch.tensor(positions, dtype=torch.int32, device=dev)
        batch = Batch(
            positions=pos_t,
            n_valid=torch.tensor([len(ids)], dtype=torch.int32, device=dev),
            attention=attention,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.int32, device=dev), pos_t, batch)
        logits = self.model.logits(hidden[torch.tensor(cu[1:], device=dev) - 1])
        return self._sample(seqs, logits)

    # --- decode ----------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        """The smallest graph bucket that holds the batch; above the largest, the batch."""
        return next((b for b in self.buckets if b >= batch), batch)

    @torch.inference_mode()
    def decode(self, seqs: list[SeqInput]) -> list[int]:
        batch = len(seqs)
        bucket = self.bucket_for(batch)
        if bucket > self.max_rows:
            raise ValueError(f"decode batch {batch} exceeds max_batch_size {self.max_rows}")
        self.prepare_decode(seqs, bucket)
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self.decode_step(bucket)
        return self._sample(seqs, logits[:batch])

    def prepare_decode(self, seqs: list[SeqInput], bucket: int) -> None:
        """Host side: fill the static buffers (padded rows write to the scratch block and
        attend to nothing) and, for latent layers, the compaction plan."""
        batch = len(seqs)
        ids = [s.tokens[-1] for s in seqs] + [0] * (bucket - batch)
        pos = [s.length - 1 for s in seqs] + [0] * (bucket - batch)
        slots = [self._slot(s.block_table, s.length - 1) for s in seqs]
        slots += [self.scratch_slot] * (bucket - batch)
        tables = torch.zeros(bucket, self.max_blocks, dtype=torch.int32)
        for b, s in enumerate(seqs):
            tables[b, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        lens = [s.length for s in seqs] + [0] * (bucket - batch)
        self.input_ids[:bucket].copy_(torch.tensor(ids, dtype=torch.int32))
        self.positions[:bucket].copy_(torch.tensor(pos, dtype=torch.int32))
        self.slots[:bucket].copy_(torch.tensor(slots, dtype=torch.long))
        self.block_tables[:bucket].copy_(tables)
        self.seq_lens[:bucket].copy_(torch.tensor(lens, dtype=torch.int32))
        self.n_tokens.fill_(batch)
        if self.latent_widths:
            plan = plan_compaction(
                [s.block_table for s in seqs],
                [s.length for s in seqs],
                self.block_size,
                self.max_blocks,
                self.max_compact,
                bucket,
            )
            self.copy_list.copy_(plan.copy_list)
            self.num_runs.copy_(plan.num_runs)
            self.remap[:bucket].copy_(plan.remap)
            self.compact_positions.copy_(plan.positions)
            self.n_rows.copy_(plan.n_rows)

    def decode_step(self, bucket: int) -> torch.Tensor:
        """The graph-safe step: fixed shapes for a bucket, every count read from device
        memory, no host synchronisation."""
        positions = self.positions[:bucket]
        batch = Batch(
            positions=positions, n_valid=self.n_tokens, attention=self._decode_attention(bucket)
        )
        hidden = self.model(self.input_ids[:bucket], positions, batch)
        return self.model.logits(hidden)

    def _decode_attention(self, bucket: int):
        backend = self.config.backend

        def attention(index, q, k, v, latent):
            cache = self.caches[index]
            cache.write(self.slots[:bucket], k, v, latent)
            out = torch.empty_like(q)
            if cache.kind == "dense":
                kernel = self.registry.get("paged_attention", (q.shape[1], k.shape[1]), backend)
                return kernel(
                    q, cache.k, cache.v, self.block_tables[:bucket], self.seq_lens[:bucket], out
                )
            k_cache, v_cache = self._reconstruct(index, k.shape[1])
            kernel = self.registry.get("paged_attention", (q.shape[1], k.shape[1]), backend)
            return kernel(q, k_cache, v_cache, self.remap[:bucket], self.seq_lens[:bucket], out)

        return attention

    def _reconstruct(self, index: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the batch's latent blocks into the compact buffer, rebuild K and V with the
        fixed-size GEMM (cost follows the valid rows), q/k norm and RoPE K in place."""
        backend, lp = self.config.backend, self.layer_plans[index]
        layer, cache = self.model.layers[index], self.caches[index]
        width, r_k = lp.kv_latent_per_rank, lp.shape.rank("k")
        d = self.spec.model.head_dim
        compact = self.compact[width]
        self.registry.get("kv_copy", width, backend)(
            cache.latent, compact, self.copy_list, self.num_runs
        )
        rows = compact.view(-1, width)
        k_rows = self.k_rows[:, : kv_heads * d]
        v_rows = self.v_rows[:, : kv_heads * d]
        for out, name, part in ((k_rows, "k", rows[:, :r_k]), (v_rows, "v", rows[:, r_k:])):
            u = layer.w(f"{name}.u")
            self.registry.get("gemm", tuple(u.shape), backend)(part, u, out, self.n_rows)
            bias = layer.w(f"{name}.bias")
            if bias is not None:
                out.add_(bias)
        keys = k_rows.view(-1, kv_heads, d)
        if self.spec.model.qk_norm:
            keys.copy_(
                apply_norm(
                    keys, layer.w("k_norm.weight"), None, norm="rms", eps=self.spec.model.norm.eps
                ).to(keys.dtype)
            )
        if layer.s.inv_freq is not None:
            self.registry.get("rope", kv_heads, backend)(
                keys, self.compact_positions, layer.s.inv_freq, self.n_rows
            )
        shape = (self.max_compact, self.block_size, kv_heads, d)
        return keys.view(shape), v_rows.view(shape)

    def capture_graphs(self) -> None:
        """CUDA graphs per batch-size bucket (GPU only); the ring all-gather is replaced by
        one all-gather inside graphs."""
        self.comm.overlap = False
        self.slots.fill_(self.scratch_slot)  # warm-up and capture write to the scratch block
        pool = None
        for bucket in reversed(self.buckets):
            self.n_tokens.fill_(bucket)
            self.decode_step(bucket)  # warm up: compile kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.decode_step(bucket)
            pool = graph.pool()
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()

    # --- sampling ----------------------------------------------------------------------

    def _sample(self, seqs: list[SeqInput], logits: torch.Tensor) -> list[int]:
        tokens = []
        for s, row in zip(seqs, logits, strict=True):
            g = self.generators.setdefault(s.id, make_generator(s.params, s.id))
            tokens.append(sample_row(row, s.params, g))
        return tokens

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.generators.pop(i, None)

    def set_comm_stats(self, mode: str) -> None:
        """off | count | timed, from now on (benchmarks time only their breakdown runs)."""
        self.comm.count, self.comm.timed = mode != "off", mode == "timed"

    def take_comm_stats(self) -> dict[str, tuple[int, int, float]]:
        """{kind: (calls, elements, seconds)} since the last call; resets the counters."""
        out = {k: (v.calls, v.elements, v.seconds) for k, v in self.comm.stats.by_kind.items()}
        self.comm.stats.by_kind.clear()
        return out

    def step(self, seqs: list[SeqInput], is_prefill: bool) -> list[int]:
        return self.prefill(seqs) if is_prefill else self.decode(seqs)
