"""This process's rank as a ``WorkerGroup`` of one: alone (tp 1), or one rank of a
``torchrun`` group where every rank runs the same driver in lockstep."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dsl.errors import UserError
from runtime.dist.failures import CallFailed, last_line


class LocalWorker:
    """This process's rank as a ``WorkerGroup`` of one: alone (tp 1), or one rank of a
    ``torchrun`` group where every rank runs the same driver in lockstep (``spmd``)."""

    def __init__(self, init: tuple[Callable[..., Any], tuple], spmd: bool = False) -> None:
        factory, args = init
        rank, world = (dist.get_rank(), dist.get_world_size()) if spmd else (0, 1)
        self.state = factory(rank, world, *args)
        self.world, self.spmd = world, spmd

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        if self.spmd:  # the peers' drivers may be anywhere: nothing is known to be intact
            return [getattr(self.state, method)(*args)]
        try:
            return [getattr(self.state, method)(*args)]
        except UserError:
            raise
        except Exception as exc:
            details = traceback.format_exc()
            raise CallFailed(last_line(details), details) from exc

    def close(self) -> None:
        self.state = None
