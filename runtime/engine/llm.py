"""The engine API: ``LLM(spec, checkpoint, tp=2, mode="deinfer").generate(prompts, params)``.

The driver (this process) owns the scheduler and the block manager; each tensor-parallel
rank owns a ``ModelRunner`` (in worker processes for tp > 1, here for tp 1). A step
sends the scheduled sequences to every rank; every rank samples the same token from the
same gathered logits with the same per-request generator, and rank 0's answer is used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from codegen import generated_folder
from dsl import Spec, build_plan, load_spec, with_tp
from dsl.errors import UserError
from dsl.layout import with_merged
from dsl.report import layer_ranges
from dsl.spec import DTYPE_BYTES
from runtime.dist.emulated_link import LinkSpec
from runtime.dist.failures import CallFailed
from runtime.dist.launcher import WorkerGroup
from runtime.dist.local_worker import LocalWorker
from runtime.dist.torchrun_group import (
    LEADER,
    TorchrunFollower,
    TorchrunLeader,
    init_from_env,
    under_torchrun,
)
from runtime.engine.block_manager import BlockManager
from runtime.engine.config import EngineFacts, EngineOptions, RunnerConfig, resolve
from runtime.engine.kv_cache import bytes_per_block
from runtime.engine.model_runner import ModelRunner
from runtime.engine.outputs import RequestOutput, StepFailed, StreamEvent
from runtime.engine.request_checks import check_params, encode_prompt
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence import SamplingParams, Sequence, Status
from runtime.engine.step_io import SeqInput
from runtime.kernels.gemm_tuning import TuningReport
from runtime.model.checkpoint import has_tokenizer

log = logging.getLogger("deinfer.engine")


def _run_runner(rank: int, world: int, config: RunnerConfig) -> ModelRunner:
    return ModelRunner(rank, world, config)


class LLM:
    """The engine. ``spec`` is a parsed ``Spec`` or the path of a spec file (read once);
    ``options`` (``EngineOptions``) says how to run it, and keyword arguments replace
    single fields of it: ``LLM(spec, ckpt, tp=2, mode="dense")``."""

    def __init__(
        self,
        spec: Spec | str | Path,
        checkpoint: str | Path,
        options: EngineOptions | None = None,
        **changes: Any,
    ) -> None:
        options = replace(options or EngineOptions(), **changes)
        spec = spec if isinstance(spec, Spec) else load_spec(spec)
        self.spec = spec if options.tp is None else with_tp(spec, options.tp)
        self.options, self.facts = options, self._resolve(options)
        self.link = self.facts.link  # set_link reshapes it
        mode = options.mode
        # The matrices the layout merges run undecomposed: plan and kernels follow the
        # execution spec; the checkpoint (read against self.spec) still holds factors.
        self.execution_spec = with_merged(self.spec, self.facts.merges)
        for shape, names in self.facts.merges.items():
            layers = layer_ranges(self.spec.layers_of_shape(shape))
            log.info("layers %s run %s merged (D·U)", layers, ", ".join(sorted(names)))
        plan = build_plan(
            self.execution_spec,
            modes=(mode,),
            up_layout=self.facts.up_layout,
            down_layout=self.facts.down_layout,
        )
        self.plan = plan.modes[mode]
        self.blocks, self.scheduler = self._scheduler()
        config = RunnerConfig(
            spec=self.spec,
            plan=self.plan,
            generated=str(generated_folder(self.execution_spec, Path(options.generated_root))),
            checkpoint=str(checkpoint),
            num_blocks=self.blocks.num_blocks,
            options=options,
            facts=self.facts,
        )
        # Before any rank starts: a bad tokenizer must not leave ranks behind.
        self.tokenizer = self._tokenizer(Path(checkpoint), self.spec.model.vocab_size)
        self._owns_group = False
        self.workers = self._start_workers(config)
        self._next_id = 0

    def _resolve(self, options: EngineOptions) -> EngineFacts:
        """What ``options`` come to for this engine's spec on this machine."""
        return resolve(options, self.spec)

    def _scheduler(self) -> tuple[BlockManager, Scheduler]:
        """A pool of ``num_blocks`` (default: what ``kv_memory_bytes`` holds); its scheduler."""
        rt = self.spec.runtime
        num_blocks = self.options.num_blocks or self._blocks_for_budget(
            self.facts.kv_cache, self.options.kv_memory_bytes
        )
        blocks = BlockManager(num_blocks, rt.block_size)
        config = SchedulerConfig(
            max_batch_size=rt.max_batch_size,
            max_seq_len=rt.max_seq_len,
            max_prefill_tokens=max(rt.max_seq_len, 2048),
        )
        return blocks, Scheduler(config, blocks)

    def _start_workers(self, config: RunnerConfig):
        tp_size, timeout_s = self.spec.parallel.tp, self.options.timeout_s
        init = (_run_runner, (config,))
        if under_torchrun():
            # Rank 0 drives; the others follow its calls (LLM.follow).
            if self.link is not None:
                raise UserError("emulated links need the built-in launcher, not torchrun")
            if not dist.is_initialized():
                init_from_env(timeout_s)
                self._owns_group = True
            if dist.get_world_size() != tp_size:
                raise UserError(f"torchrun started {dist.get_world_size()} ranks, tp is {tp_size}")
            leads = dist.get_rank() == LEADER
            return (TorchrunLeader if leads else TorchrunFollower)(init, self.options.heartbeat_s)
        if tp_size == 1:
            return LocalWorker(init)
        return WorkerGroup(
            tp_size,
            timeout_s=timeout_s,
            init=init,
            link=self.link,
            heartbeat_s=self.options.heartbeat_s,
            hosts=self.options.link_hosts,
        )

    @property
    def is_leader(self) -> bool:
        """False on the ranks of a ``torchrun`` job other than 0, which only ``follow``."""
        return not isinstance(self.workers, TorchrunFollower)

    def follow(self) -> None:
        """On a ``torchrun`` rank other than 0: run rank 0's calls until it closes."""
        if self.is_leader:
            raise UserError("follow is for the ranks of a torchrun job other than 0")
        self.workers.follow()

    def tuning(self) -> TuningReport:
        """What start-up's tuning of the products did on rank 0."""
        return self.workers.call("tuning_report")[0]

    def describe_path(self) -> str:
        """e.g. "dynamic path (eager kernels), 2 threads per rank"."""
        facts = self.facts
        threads = f"{facts.threads} thread{'' if facts.threads == 1 else 's'} per rank"
        text = f"{facts.path} path ({facts.kernels} kernels), {threads}"
        probe = getattr(self.workers, "link_probe", None)
        if self.link is not None and probe:
            hosts, world = self.workers.hosts, self.workers.world
            between = f" between {hosts} hosts of {world // hosts} ranks" if hosts < world else ""
            text += (
                f"; emulated link {self.link.describe()}{between}: one all-gather of "
                f"{probe['bytes'] / 1e6:.2f} MB per rank received "
                f"{probe['bytes_per_s'] / 1e6:.1f} MB/s per rank"
            )
        return text

    def set_link(self, link: LinkSpec | str, probe: bool = True) -> dict[str, float] | None:
        """Reshape the emulated links between the ranks; the all-gather probe measured
        across them (unless ``probe`` is False)."""
        self.link = LinkSpec.parse(link) if isinstance(link, str) else link
        if not isinstance(self.workers, WorkerGroup) or self.workers.links is None:
            raise UserError("set_link needs an engine started with link=... at tp >= 2")
        return self.workers.set_link(self.link, probe)

    def _blocks_for_budget(self, kv: str, budget: int) -> int:
        rt = self.spec.runtime
        plans = list(self.plan.per_layer())
        kinds = [lp.cache_kind(kv) for lp in plans]
        per_block = bytes_per_block(plans, kinds, rt.block_size, DTYPE_BYTES[rt.dtype])
        wanted = rt.max_batch_size * -(-rt.max_seq_len // rt.block_size)
        return max(1, min(wanted, budget // max(1, per_block)))

    @staticmethod
    def _tokenizer(checkpoint: Path, vocab: int):
        if not has_tokenizer(checkpoint):
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        if len(tokenizer) > vocab:
            raise UserError(
                f"the tokenizer in {checkpoint} has {len(tokenizer)} tokens, more than the "
                f"model's vocabulary of {vocab} (its ids from {vocab} up have no embedding)"
            )
        return tokenizer

    # --- requests ----------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.spec.model.vocab_size)

    def _check_params(self, params: SamplingParams) -> None:
        check_params(params, self.spec.model.vocab_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        self._check_params(params)
        seq = Sequence(id=self._next_id, prompt=self._encode(prompt), params=params)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[tuple[Sequence, int, float]]:
        """One scheduler step: (sequence, new token, time) for each sequence it advanced.
        Raises ``StepFailed`` when the ranks raised but stayed in step: that step's
        sequences are ended with the error and the engine can go on."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        inputs = [
            SeqInput(
                id=s.id,
                tokens=s.tokens if is_prefill else s.tokens[-1:],
                length=len(s),
                block_table=list(s.block_table),
                params=s.params,
                prompt_logprobs=is_prefill and _wants_prompt_logprobs(s),
            )
            for s in seqs
        ]
        try:
            out = self.workers.call("step", inputs, is_prefill)[0]
        except (CallFailed, UserError) as exc:
            raise self._failed(seqs, exc) from exc
        for i, scored in out.prompt_logprobs.items():
            seqs[i].prompt_logprobs = scored
        now = time.perf_counter()
        events = []
        finished = []
        for i, (s, token) in enumerate(zip(seqs, out.tokens, strict=True)):
            s.output.append(token)
            if out.logprobs is not None and out.logprobs[i] is not None:
                s.logprobs.append(out.logprobs[i])
            events.append((s, token, now))
            if token in s.params.stop_token_ids:
                self.scheduler.finish(s, "stop")
            elif len(s.output) >= s.params.max_tokens:
                self.scheduler.finish(s, "length")
            if s.status is Status.FINISHED:
                finished.append(s.id)
        if finished:
            self.workers.call("release", finished)
        return events

    def _failed(self, seqs: list[Sequence], exc: Exception) -> StepFailed:
        """End the sequences of a step that raised, free their blocks, say why once."""
        reason = f"the step failed: {exc}"
        for s in seqs:
            if s.status is not Status.FINISHED:
                self.scheduler.finish(s, f"error: {reason}")
        self.workers.call("release", [s.id for s in seqs])
        log.error("%s (%d requests ended)", reason, len(seqs))
        return StepFailed(reason, seqs, getattr(exc, "details", ""))

    def unfit_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run on this engine (too long for
        max_seq_len, more blocks than the pool has), or None."""
        return self.scheduler.unfit_reason(prompt_len, max_tokens)

    def abort(self, seq: Sequence) -> None:
        """End a request now, waiting or running; its blocks return to the pool."""
        if self.scheduler.abort(seq):
            self.workers.call("release", [seq.id])

    def score(self, prompt: str | list[int]) -> torch.Tensor:
        """Log-probabilities [L, vocab] of the next token after each prompt position
        (teacher forcing), through the serving path; needs an idle engine."""
        if self.scheduler.has_work():
            raise UserError("score needs an idle engine (requests are still running)")
        seq = Sequence(id=self._next_id, prompt=self._encode(prompt), params=SamplingParams())
        self._next_id += 1
        if not 1 <= len(seq) <= self.spec.runtime.max_seq_len:
            raise UserError(
                f"score: {len(seq)} tokens, expected 1 to runtime.max_seq_len "
                f"({self.spec.runtime.max_seq_len})"
            )
        if not self.blocks.can_allocate(seq):
            raise UserError(f"score: {len(seq)} tokens do not fit in the KV-cache pool")
        self.blocks.allocate(seq)
        try:
            inputs = SeqInput(seq.id, seq.prompt, len(seq), list(seq.block_table), seq.params)
            return self.workers.call("score", inputs)[0]
        finally:
            self.blocks.free_sequence(seq)

    def _submit(self, prompts, params) -> list[Sequence]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        # Every prompt checked before any is queued: a bad one changes nothing.
        for sp in params:
            self._check_params(sp)
        encoded = [self._encode(p) for p in prompts]
        return [self.add_request(ids, sp) for ids, sp in zip(encoded, params, strict=True)]

    def stream(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        """Tokens as they are produced, with timestamps (for TTFT and ITL)."""
        seqs = self._submit(prompts, params)
        index = {s.id: i for i, s in enumerate(seqs)}
        while self.scheduler.has_work():
            try:
                events = self.step()
            except StepFailed as exc:
                for s in exc.sequences:
                    if s.id in index:
                        now = time.perf_counter()
                        yield StreamEvent(index[s.id], None, now, True, s.finish_reason)
                continue
            for s, token, t in events:
                if s.id in index:
                    yield StreamEvent(index[s.id], token, t, s.status is Status.FINISHED)

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        start = time.perf_counter()
        seqs = self._submit(prompts, params)
        index = {s.id: i for i, s in enumerate(seqs)}
        times: list[list[float]] = [[] for _ in seqs]
        while self.scheduler.has_work():
            try:
                events = self.step()
            except StepFailed:
                continue  # those requests end with finish_reason "error: ..."
            for s, _, t in events:
                if s.id in index:
                    times[index[s.id]].append(t)
        return [
            RequestOutput(
                prompt_token_ids=s.prompt,
                token_ids=s.output,
                finish_reason=s.finish_reason,
                text=self.tokenizer.decode(s.output) if self.tokenizer else None,
                arrival=start,
                token_times=times[i],
                num_preemptions=s.num_preemptions,
                logprobs=s.logprobs,
                prompt_logprobs=s.prompt_logprobs,
            )
            for i, s in enumerate(seqs)
        ]

    def close(self) -> None:
        self.workers.close()
        if self._owns_group and dist.is_initialized():
            # Under torchrun: leave together and take the group down, so no rank exits
            # while a peer's gloo threads still talk to it (that aborts the process).
            dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """Prompt log-probabilities are computed once, at the first prefill (a preempted
    sequence prefills again with its output appended)."""
    return seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None
