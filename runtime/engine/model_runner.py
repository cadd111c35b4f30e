"""One rank's model runner: weights, paged KV cache, chunked prefill and decode on one
of two paths. ``static`` (GPU): fixed buffers per batch-size bucket, captured as CUDA
graphs (``runtime.engine.static_decode``). ``dynamic`` (CPU): every shape follows the batch,
work proportional to the tokens that exist (``runtime.model.eager_attention``)."""

from __future__ import annotations

import time

import torch

from dsl.plan import ModePlan
from runtime.dist.comm import Comm
from runtime.dist.shm_collectives import SPINS, SharedMemoryCollectives
from runtime.engine.cache_attention import CacheAttention
from runtime.engine.config import RunnerConfig
from runtime.engine.kv_cache import allocate
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
from runtime.kernels.cpu_gemm import CpuGemm, choose, group_by_shape
from runtime.kernels.gemm_tuning import (
    TuningCache,
    TuningProgress,
    TuningReport,
    cache_dir,
    tune_cpu_gemm,
)
from runtime.kernels.huge_pages import return_freed_heap
from runtime.kernels.loader import load_generated
from runtime.model.eager_attention import LatentFactors
from runtime.model.execution import execution_for
from runtime.model.paged_cache import LayerCache
from runtime.model.transformer import TPModel
from runtime.model.weights import load_rank_weights

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, rank: int, world: int, config: RunnerConfig) -> None:
        if config.spec.parallel.tp != world:
            raise ValueError(f"the spec is planned for tp {config.spec.parallel.tp}, not {world}")
        torch.set_num_threads(config.facts.threads)
        self.rank, self.config, self.spec = rank, config, config.spec
        self.options, self.facts = config.options, config.facts
        self.gemm = CpuGemm()
        self.tuning = TuningReport()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.registry = load_generated(config.generated).KERNELS
        self.comm = self._comm(rank, world)
        mode_plan = config.plan
        self.up_layout = mode_plan.up_layout  # replicated wherever nothing is split
        self.model = self._model(mode_plan)
        return_freed_heap()  # the checkpoint's slices and the eager layout's copies
        self.layer_plans = list(mode_plan.per_layer())
        self.kinds = [lp.cache_kind(self.facts.kv_cache) for lp in self.layer_plans]
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
        self.attention = CacheAttention(
            self.caches,
            self.latent_factors,
            rt.block_size,
            self.scale,
            self.inv_freq,
            m.positions.style,
            self.device,
        )
        self.generators: dict[int, torch.Generator] = {}
        self.output_counts: dict[int, dict[int, int]] = {}  # penalised sequences' tokens
        self.static = self._static_decoder(mode_plan) if self.facts.static else None

    def _comm(self, rank: int, world: int) -> Comm:
        options = self.options
        comm = Comm(count=options.comm_stats != "off", timed=options.comm_stats == "timed")
        comm.overlap = options.overlap
        if self.facts.shm_collectives:
            spins = 0 if self.facts.shared_cores else SPINS
            comm.shm = SharedMemoryCollectives(rank, world, capacity=4 << 20, spins=spins)
        return comm

    def _model(self, mode_plan: ModePlan) -> TPModel:
        options, facts, spec = self.options, self.facts, self.spec
        weights = load_rank_weights(
            self.config.checkpoint,
            spec,
            mode_plan,
            self.rank,
            DTYPES[spec.runtime.dtype],
            kv_cache=facts.kv_cache,
            allow_extreme=options.allow_extreme_weights,
        )
        self.execution = execution_for(spec.model, self.registry, facts.kernels)
        model = TPModel(
            spec, mode_plan, self.rank, self.comm, self.execution, weights, facts.kv_cache
        )
        model = model.to(self.device)
        if not facts.static:
            model.prepare_eager()
            if options.tune_gemm and self.device.type == "cpu":
                start = time.perf_counter()
                # the native decode blocks' matrices are panels in every bucket, untimed
                panels = model.decode_block_matrices() if options.pack_weights else []
                fixed = {id(b) for b in panels}
                timings, self.tuning = tune_cpu_gemm(
                    [b for b in model.matrices() if id(b) not in fixed],
                    options.tune_budget,
                    TuningCache(cache_dir()).load() if options.tune_cache else None,
                    options.pack_weights,
                    progress=TuningProgress() if self.rank == 0 else None,
                    group=self.comm.group,
                    streamed_besides=sum(b.numel() * b.element_size() for b in panels),
                )
                self.tuning.seconds = time.perf_counter() - start
                self.gemm = choose(timings, panel_shapes=group_by_shape(panels))
                self.gemm.pack(model.matrices())
                # a matrix multiplied only in its reordered form is kept in that form alone
                model.release_matrices(self.gemm.release)
                model.prepare_decode_blocks()
                self.execution.use(self.gemm)
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
        widths = mode_plan.latent_widths(self.facts.kv_cache)
        static = StaticDecoder(self.model, self.caches, widths, shapes)
        if self.options.cuda_graphs and self.device.type == "cuda":
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

    def prefill(self, seqs: list[SeqInput]) -> Sampled:
        """Whole prompts, batched, in chunks of at most ``prefill_chunk`` tokens; a chunk
        that continues a prompt attends to the part already in the cache."""
        last_hidden: dict[int, torch.Tensor] = {}
        scored: dict[int, list[TokenLogprobs | None]] = {
            i: [None] for i, s in enumerate(seqs) if s.prompt_logprobs
        }
        for chunk in prefill_chunks([s.length for s in seqs], self.options.prefill_chunk):
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
            for chunk in prefill_chunks([seq.length], self.options.prefill_chunk)
        ]
        return torch.log_softmax(self.model.logits(torch.cat(hidden)).float(), dim=-1)

    def _prefill_chunk(self, seqs: list[SeqInput], chunk: list[Piece]) -> torch.Tensor:
        ids = [t for p in chunk for t in seqs[p.seq].tokens[p.start : p.stop]]
        positions = [i for p in chunk for i in range(p.start, p.stop)]
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int32, device=dev)
        n = torch.tensor([len(ids)], dtype=torch.int32, device=dev)
        attention = self.attention.prefill(seqs, chunk)
        batch = self.execution.batch(pos_t, n, attention, self.inv_freq)
        return self.model.forward(torch.tensor(ids, dtype=torch.int32, device=dev), pos_t, batch)

    # --- decode ----------------------------------------------------------------------

    def decode(self, seqs: list[SeqInput]) -> Sampled:
        """One new token per sequence: the static path's step (fixed shapes, a CUDA graph
        per bucket), or one at the batch's real shapes."""
        if self.static is not None:
            return self._sample(seqs, self.static.decode(seqs, self.attention.slot))
        dev = self.device
        ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.int32, device=dev)
        pos = torch.tensor([s.length - 1 for s in seqs], dtype=torch.int32, device=dev)
        n = torch.tensor([len(seqs)], dtype=torch.int32, device=dev)
        attention, decode_cache = self.attention.decode(seqs)
        batch = self.execution.batch(pos, n, attention, self.inv_freq, True, decode_cache)
        return self._sample(seqs, self.model.logits(self.model.forward(ids, pos, batch)))

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

    def tuning_report(self) -> TuningReport:
        """What start-up's tuning did: shapes, shapes timed, from the cache, seconds."""
        return self.tuning

    def decode_block_layers(self) -> int:
        """How many layers take their decode steps through the native decode block."""
        return sum(getattr(layer, "decode_block", None) is not None for layer in self.model.layers)

    def decode_stack_layers(self) -> int:
        """How many layers a decode step runs in one native call (``DecodeStack``: one
        rank, every layer through native halves: its block, or a latent cache's two)."""
        stack = self.model.decode_stack
        return 0 if stack is None else len(stack.layers)

    def mlp_half_layers(self) -> int:
        """How many latent-cache layers take their decode steps' MLP through the native
        block's MLP half."""
        return sum(getattr(layer, "mlp_half", None) is not None for layer in self.model.layers)

    def latent_half_layers(self) -> int:
        """How many of those take their attention's projections through native calls too
        (``LatentAttentionHalf``)."""
        return sum(getattr(layer, "latent_half", None) is not None for layer in self.model.layers)

    def pending_up_groups(self) -> int:
        """How many row groups' up products the next half's native call makes (across
        ranks: ``runtime.model.pending_up.PendingUp``)."""
        return sum(len(getattr(layer, "pending_ups", {})) for layer in self.model.layers)

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
        self.comm.overlap = self.options.overlap and rows >= self.options.overlap_min_rows
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.prefill(seqs) if is_prefill else self.decode(seqs)
        if self.comm.timed:  # the rank's own time per step, beside the comm's
            self.comm.stats.record("step:rank", 0, time.perf_counter() - start)
        return out
