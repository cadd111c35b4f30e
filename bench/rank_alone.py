"""One rank of a tp N engine alone, for timing: what tp N would take per step if its
ranks never waited for each other or for the driver.

``RankAloneLLM`` builds rank 0 of a tp N engine in this process with no process group:
the rank holds its shard of every weight and its share of the heads and runs exactly
its own work, but its collectives wait for no one (``SoloComm``): a sum leaves the rank's
own values, a gather copies them into every rank's place, so partial sums are never
summed and its tokens mean nothing. Set beside the real tp N engine in lockstep,
the two rows split a tp N step into the rank's own work and what synchronising costs:
the waits at the collectives (a core that briefly runs something else holds up the
other rank), the collectives' copies and the driver's hand-offs to the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from dsl.errors import UserError
from runtime.dist.comm import Comm
from runtime.dist.local_worker import LocalWorker
from runtime.engine.config import EngineFacts, EngineOptions, RunnerConfig, resolve
from runtime.engine.llm import LLM
from runtime.engine.model_runner import ModelRunner


class SoloComm(Comm):
    """Rank 0 of ``world`` with no peers: every collective returns at once with the
    shapes the real one gives, from this rank's values alone."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.rank = world, 0

    def all_reduce(self, tensor: torch.Tensor, tag: str = "") -> torch.Tensor:
        return tensor

    def summands(self, tensor: torch.Tensor, tag: str = "") -> list[torch.Tensor]:
        return [tensor]

    def all_gather_columns(self, local: torch.Tensor, tag: str = "") -> torch.Tensor:
        return local.repeat(1, self.world)

    def all_gather_chunks(
        self, local: torch.Tensor, chunks: torch.Tensor
    ) -> Iterator[tuple[int, torch.Tensor]]:
        chunks.copy_(local.expand_as(chunks))
        yield from enumerate(chunks)

    def rings(self, local: torch.Tensor) -> bool:
        return False


class RankAloneRunner(ModelRunner):
    """Rank 0 of the spec's tp degree, its collectives ``SoloComm``'s."""

    def _comm(self, rank: int, world: int) -> Comm:
        return SoloComm(world)


def _rank_zero(rank: int, world: int, config: RunnerConfig) -> ModelRunner:
    """``LocalWorker`` passes this process's rank 0 of 1; the rank is 0 of the spec's tp."""
    return RankAloneRunner(0, config.spec.parallel.tp, config)


class RankAloneLLM(LLM):
    """``LLM`` whose one worker is rank 0 of the spec's tp degree, in this process, with
    ``SoloComm``'s collectives. For timing only (see the module)."""

    def _resolve(self, options: EngineOptions) -> EngineFacts:
        if dist.is_initialized():
            raise UserError("a rank-alone engine runs without a process group")
        if options.link is not None:
            raise UserError("a rank-alone engine has no link: it sends nothing")
        # the up layout the real ranks pick; no shared memory: this rank talks to no one
        return replace(resolve(options, self.spec), shm_collectives=False)

    def _start_workers(self, config: RunnerConfig):
        return LocalWorker((_rank_zero, (config,)))
