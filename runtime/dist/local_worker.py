"""This process as a ``WorkerGroup`` of one rank (tp 1)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from dsl.errors import UserError
from runtime.dist.failures import CallFailed, last_line


class LocalWorker:
    """This process as a ``WorkerGroup`` of one rank (tp 1): the runner lives here."""

    world = 1

    def __init__(self, init: tuple[Callable[..., Any], tuple]) -> None:
        factory, args = init
        self.state = factory(0, 1, *args)

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        try:
            return [getattr(self.state, method)(*args)]
        except UserError:
            raise
        except Exception as exc:
            details = traceback.format_exc()
            raise CallFailed(last_line(details), details) from exc

    def close(self) -> None:
        self.state = None
