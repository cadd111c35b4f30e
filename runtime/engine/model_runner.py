"""One rank's model runner: weights, paged KV cache, chunked prefill and decode on one
of two paths. ``static`` (GPU): fixed buffers per batch-size bucket, captured as CUDA
graphs (``runtime.engine.static_decode``). ``dynamic`` (CPU): every shape follows the batch,
work proportional to the tokens that exist (``runtime.model.eager_attention``)."""

from __future__ import annotations

import time

import torch

from dsl import build_plan
from dsl.plan import ModePlan
from runtime.dist.comm import Comm
from runtime.dist.shm_collectives import SharedMemoryCollectives
from runtime.dist.shm_collectives import available as shm_available
from runtime.engine.kv_cache import allocate
from runtime.engine.runner_config import PATHS, RunnerConfig, up_layout_for
from runtime.engine.sampling import (
    TokenLogprobs,
    adjusted,
    make_generator,
    prompt_token_logprobs,
    sample,
    token_logprobs,
)
from runtime.engine.static_decode import StaticDecoder, StaticShapes
from runtime.engine.step_io import Piece, Sampled, SeqInput, prefill_chunks
from runtime.kernels.cpu_gemm import CpuGemm, choose, sum_over_ranks, time_cpu_gemm
from runtime.kernels.eager import rope_tables
from runtime.kernels.huge_pages import return_freed_heap
from runtime.kernels.loader import load_generated
from runtime.model.eager_attention import (
    CacheContext,
    LatentFactors,
    cache_context,
    causal_attention,
    decode_dense,
    decode_latent,
    gather,
)
from runtime.model.layers import Batch
from runtime.model.paged_cache import LayerCache
from runtime.model.transformer import TPModel
from runtime.model.weights import load_rank_weights

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, rank: int, world: int, config: RunnerConfig) -> None:
        if config.path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, found {config.path!r}")
        if config.spec.parallel.tp != world:
            raise ValueError(f"the spec is planned for tp {config.spec.parallel.tp}, not {world}")
        if config.threads:
            torch.set_num_threads(config.threads)
        self.rank, self.config, self.spec = rank, config, config.spec
        self.gemm = CpuGemm()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.registry = load_generated(config.generated).KERNELS
        self.comm = self._comm(rank, world)
        layout = up_layout_for(config.up_layout, self.comm)
        mode_plan = build_plan(self.spec, modes=(config.mode,), up_layout=layout).modes[config.mode]
        self.up_layout = mode_plan.up_layout  # replicated wherever nothing is split
        self.model = self._model(mode_plan)
        return_freed_heap()  # the checkpoint's slices and the eager layout's copies
        self.layer_plans = [mode_plan.layer_plan(r) for r in self.spec.decomposition.layers]
        self.kinds = [lp.cache_kind(config.kv_cache) for lp in self.layer_plans]
        rt, m = self.spec.runtime, self.spec.model
        self.block_size = rt.block_size
        self.scale = m.head_dim**-0.5
        self.inv_freq = self.model.layers[0].s.inv_freq
        self.caches: list[LayerCache] = allocate(
            self.layer_plans,
            self.kinds,
            config.num_blocks,
            rt.block_size,
            m.head_dim,
            DTYPES[rt.dtype],
            self.device,
        )
        self.latent_factors = {
            i: self._latent_factors(i) for i, kind in enumerate(self.kinds) if kind == "latent"
        }
        self.generators: dict[int, torch.Generator] = {}
        self.output_counts: dict[int, dict[int, int]] = {}  # penalised sequences' tokens
        self.static = self._static_decoder(mode_plan) if config.path == "static" else None

    def _comm(self, rank: int, world: int) -> Comm:
        config = self.config
        comm = Comm(count=config.comm_stats != "off", timed=config.comm_stats == "timed")
        comm.overlap = config.overlap
        cpu_group = world > 1 and self.device.type == "cpu"
        if config.shm_collectives and cpu_group and shm_available(world):
            comm.shm = SharedMemoryCollectives(rank, world, capacity=4 << 20)
        return comm

    def _model(self, mode_plan: ModePlan) -> TPModel:
        config, spec = self.config, self.spec
        weights = load_rank_weights(
            config.checkpoint,
            spec,
            mode_plan,
            self.rank,
            DTYPES[spec.runtime.dtype],
            kv_cache=config.kv_cache,
            allow_extreme=config.allow_extreme_weights,
        )
        backend = config.backend if config.path == "static" else "eager"
        model = TPModel(
            spec, mode_plan, self.rank, self.comm, self.registry, backend, weights, config.kv_cache
        )
        model = model.to(self.device)
        if config.path == "dynamic":
            model.prepare_eager()
            if config.tune_gemm and self.device.type == "cpu":
                timings = time_cpu_gemm(model.matrices(), packing=config.pack_weights)
                timings = sum_over_ranks(timings, self.comm.group)
                self.gemm = choose(timings)
                self.gemm.pack(model.matrices())
                # a matrix multiplied only in its reordered form is kept in that form alone
                model.release_matrices(self.gemm.release)
                model.use_gemm(self.gemm)
        return model

    def _static_decoder(self, mode_plan: ModePlan) -> StaticDecoder:
        rt = self.spec.runtime
        buckets = tuple(sorted(rt.cuda_graph_batch_sizes) or [rt.max_batch_size])
        shapes = StaticShapes(
            rows=max(rt.max_batch_size, buckets[-1]),
            max_blocks=-(-rt.max_seq_len // rt.block_size),
            block_size=rt.block_size,
            num_blocks=self.config.num_blocks,
            buckets=buckets,
        )
        widths = mode_plan.latent_widths(self.config.kv_cache)
        static = StaticDecoder(self.model, self.caches, widths, shapes, self.config.backend)
        if self.config.cuda_graphs and self.device.type == "cuda":
            static.capture_graphs(self.comm)
        return static

    def _latent_factors(self, index: int) -> LatentFactors:
        layer, m = self.model.layers[index], self.spec.model
        u_k = layer.w("k.u")
        return LatentFactors(
            r_k=u_k.shape[0],
            kv_heads=self.layer_plans[index].kv_heads_per_rank,
            head_dim=m.head_dim,
            u_k=u_k,
            u_v=layer.w("v.u").contiguous(),
            bias_k=layer.w("k.bias"),
            bias_v=layer.w("v.bias"),
            k_norm=layer.w("k_norm.weight") if m.qk_norm else None,
            eps=m.norm.eps,
            rope_style=m.positions.rope_style,
            inv_freq=self.inv_freq,
        )

    # --- prefill ---------------------------------------------------------------------

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqInput]) -> Sampled:
        """Whole prompts, batched, in chunks of at most ``prefill_chunk`` tokens; a chunk
        that continues a prompt attends to the part already in the cache."""
        last_hidden: dict[int, torch.Tensor] = {}
        scored: dict[int, list[TokenLogprobs | None]] = {
            i: [None] for i, s in enumerate(seqs) if s.prompt_logprobs
        }
        for chunk in prefill_chunks([s.length for s in seqs], self.config.prefill_chunk):
            hidden = self._prefill_chunk(seqs, chunk)
            row = 0
            for piece in chunk:
                rows = slice(row, row + piece.stop - piece.start)
                row = rows.stop
                if piece.seq in scored:
                    scored[piece.seq] += self._score_piece(seqs[piece.seq], piece, hidden[rows])
                if piece.stop == seqs[piece.seq].length:
                    last_hidden[piece.seq] = hidden[row - 1]
        rows = torch.stack([last_hidden[i] for i in range(len(seqs))])
        sampled = self._sample(seqs, self.model.logits(rows))
        return Sampled(sampled.tokens, sampled.logprobs, scored)

    def _score_piece(
        self, seq: SeqInput, piece: Piece, hidden: torch.Tensor
    ) -> list[TokenLogprobs]:
        """The log-probabilities of the prompt tokens this piece's rows predict (row p
        predicts token p + 1; the last token's prediction is the sampled one)."""
        stop = min(piece.stop, seq.length - 1)
        if stop <= piece.start:
            return []
        logits = self.model.logits(hidden[: stop - piece.start])
        targets = seq.tokens[piece.start + 1 : stop + 1]
        return prompt_token_logprobs(logits, targets, seq.params.prompt_logprobs or 0)

    @torch.inference_mode()
    def score(self, seq: SeqInput) -> torch.Tensor:
        """Log-probabilities [L, vocab] (fp32) of the token after each of the prompt's L
        positions: one prefill whose every row goes through the LM head."""
        hidden = [
            self._prefill_chunk([seq], chunk)
            for chunk in prefill_chunks([seq.length], self.config.prefill_chunk)
        ]
        return torch.log_softmax(self.model.logits(torch.cat(hidden)).float(), dim=-1)

    def _prefill_chunk(self, seqs: list[SeqInput], chunk: list[Piece]) -> torch.Tensor:
        ids, positions, slots = [], [], []
        for piece in chunk:
            s = seqs[piece.seq]
            ids += s.tokens[piece.start : piece.stop]
            positions += range(piece.start, piece.stop)
            slots += [self._slot(s.block_table, p) for p in range(piece.start, piece.stop)]
        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int32, device=dev)
        contexts = {
            i: cache_context(
                [seqs[p.seq].block_table],
                [p.stop],
                self.block_size,
                self.inv_freq,
                dev,
                self.spec.model.positions.style,
            )
            for i, p in enumerate(chunk)
            if p.start
        }

        def attention(index, q, k, v, latent):
            cache = self.caches[index]
            cache.write(slot_t, k, v, latent)
            out, row = torch.empty_like(q), 0
            for i, p in enumerate(chunk):
                rows = slice(row, row + p.stop - p.start)
                row = rows.stop
                if i in contexts:  # keys 0..stop-1 from the cache, this chunk's included
                    k_ctx, v_ctx = self._cached_kv(index, contexts[i])
                else:
                    k_ctx, v_ctx = k[rows], v[rows]
                out[rows] = causal_attention(q[rows], k_ctx, v_ctx, p.start, self.scale)
            return out

        n = torch.tensor([len(ids)], dtype=torch.int32, device=dev)
        batch = Batch(pos_t, n, attention, self._rope_angles(pos_t))
        return self.model(torch.tensor(ids, dtype=torch.int32, device=dev), pos_t, batch)

    def _cached_kv(self, index: int, ctx: CacheContext) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, kv_heads, head_dim] of one sequence's cached tokens."""
        cache, slots = self.caches[index], ctx.slots[0]
        if cache.kind == "dense":
            return gather(cache.k, slots), gather(cache.v, slots)
        f = self.latent_factors[index]
        z = gather(cache.latent, slots)
        return f.keys(z[:, : f.r_k], ctx.cos, ctx.sin), f.values(z[:, f.r_k :])

    def _rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``Batch.rope_angles``: the eager path's tables [T, 1, head_dim]."""
        if self.static is not None or self.inv_freq is None:
            return None
        cos, sin = rope_tables(positions, self.inv_freq, self.spec.model.positions.style)
        return cos[:, None, :], sin[:, None, :]

    # --- decode ----------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, seqs: list[SeqInput]) -> Sampled:
        if self.static is not None:
            return self._sample(seqs, self.static.decode(seqs, self._slot))
        return self._sample(seqs, self._decode_dynamic(seqs))

    def _decode_dynamic(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One decode step at the batch's real shapes (the CPU path)."""
        dev = self.device
        ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.int32, device=dev)
        pos = torch.tensor([s.length - 1 for s in seqs], dtype=torch.int32, device=dev)
        slots = torch.tensor(
            [self._slot(s.block_table, s.length - 1) for s in seqs], dtype=torch.long, device=dev
        )
        ctx = cache_context(
            [s.block_table for s in seqs],
            [s.length for s in seqs],
            self.block_size,
            self.inv_freq,
            dev,
            self.spec.model.positions.style,
        )

        def attention(index, q, k, v, latent):
            cache = self.caches[index]
            cache.write(slots, k, v, latent)
            if cache.kind == "dense":
                return decode_dense(q, cache, ctx, self.scale)
            return decode_latent(q, cache, ctx, self.latent_factors[index], self.scale)

        n = torch.tensor([len(seqs)], dtype=torch.int32, device=dev)
        batch = Batch(pos, n, attention, self._rope_angles(pos), keys_from_cache=True)
        return self.model.logits(self.model(ids, pos, batch))

    # --- sampling ----------------------------------------------------------------------

    def _sample(self, seqs: list[SeqInput], logits: torch.Tensor) -> Sampled:
        generators = []
        for s in seqs:
            if s.params.temperature > 0 and s.id not in self.generators:
                self.generators[s.id] = make_generator(s.params, s.id)
            generators.append(self.generators.get(s.id))
        params = [s.params for s in seqs]
        seen = [self.output_counts.get(s.id) for s in seqs]
        tokens = sample(adjusted(logits, params, seen), params, generators)
        for s, token in zip(seqs, tokens, strict=True):
            if s.params.frequency_penalty or s.params.presence_penalty:
                counts = self.output_counts.setdefault(s.id, {})
                counts[token] = counts.get(token, 0) + 1
        wanted = [s.params.logprobs for s in seqs]
        if all(n is None for n in wanted):
            return Sampled(tokens)
        return Sampled(tokens, token_logprobs(logits, tokens, wanted))

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.generators.pop(i, None)
            self.output_counts.pop(i, None)

    def set_comm_stats(self, mode: str) -> None:
        """off | count | timed, from now on (benchmarks time only their breakdown runs)."""
        self.comm.count, self.comm.timed = mode != "off", mode == "timed"

    def take_comm_stats(self) -> dict[str, tuple[int, int, float]]:
        """{kind: (calls, elements, seconds)} since the last call; resets the counters."""
        out = {k: (v.calls, v.elements, v.seconds) for k, v in self.comm.stats.by_kind.items()}
        self.comm.stats.by_kind.clear()
        return out

    def streamed_weight_bytes(self) -> int:
        """Bytes a decode step must read: every layer's weights, the final norm and the
        LM head (the embedding is only looked up)."""
        tensors = [*self.model.layers.buffers(), *self.model.final_norm.values()]
        tensors.append(self.model.lm_head)
        released = self.gemm.released_bytes()  # the weights kept in a tuned form alone
        return sum(t.numel() * t.element_size() for t in tensors) + released

    def plan_up_layout(self) -> str:
        """How this rank holds deinfer's o/down up factors (``auto`` resolved)."""
        return self.up_layout

    def latent_key_copies(self) -> dict[int, tuple[int, int]]:
        """Per latent-cache layer: (key columns decode copies from the latent, key columns
        this rank rebuilds in all); the copies cost no GEMM (``runtime.model.latent_basis``)."""
        return {i: (f.copies, f.kv_heads * f.head_dim) for i, f in self.latent_factors.items()}

    def packed_weight_bytes(self) -> int:
        """Bytes of the reordered weight copies the tuned products keep."""
        return self.gemm.packed_bytes()

    def released_weight_bytes(self) -> int:
        """Bytes of the weights kept only in a tuned product's layout (no second copy)."""
        return self.gemm.released_bytes()

    def gemm_forms(self) -> dict[str, dict[str, str]]:
        """The tuned product forms, {"KxN": {rows: form}} (empty when not tuned)."""
        return self.gemm.describe()

    def threads(self, count: int | None = None) -> int:
        """Set (when given) and return this rank's intra-op threads."""
        if count:
            torch.set_num_threads(count)
        return torch.get_num_threads()

    def step(self, seqs: list[SeqInput], is_prefill: bool) -> Sampled:
        rows = sum(len(s.tokens) for s in seqs) if is_prefill else len(seqs)
        # The ring pays a call per step that one all-gather does not; it wins only once
        # the up GEMM it hides is worth more (``deinfer predict`` says from how many rows).
        self.comm.overlap = self.config.overlap and rows >= self.config.overlap_min_rows
        if not self.comm.timed:
            return self.prefill(seqs) if is_prefill else self.decode(seqs)
        start = time.perf_counter()  # timed: the rank's own time per step, beside the comm's
        out = self.prefill(seqs) if is_prefill else self.decode(seqs)
        self.comm.stats.record("step:rank", 0, time.perf_counter() - start)
        return out
