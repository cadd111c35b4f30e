"""How a rank's failure reaches the driver: the exception types, the one line that names
it, and the rank's side that turns an exception into what it reports."""

from __future__ import annotations

import traceback

from dsl.errors import RuntimeFailure, UserError


class WorkerError(RuntimeFailure):
    """A worker rank failed, died or hung; the group is gone. The message is one line;
    ``details`` holds the rank's traceback when there is one."""


class CallFailed(RuntimeFailure):
    """A call raised (on some or all ranks) but every rank answered: the group is intact
    and the next call may go on. One line; ``details`` holds a traceback."""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def rank_failure(exc: Exception) -> tuple[str, str]:
    """("user_error", message) for the user's mistake (every rank says the same: the
    driver shows it once, in one line); ("error", traceback) for anything else."""
    if isinstance(exc, UserError):
        return "user_error", str(exc)
    return "error", traceback.format_exc()


# What a rank's collective raises once a peer's side of the connection went away (the peer
# failed, or its group closed): a symptom of another rank's failure, not a cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def first_cause(failed: dict[int, tuple[str, str]]) -> int:
    """Of the ranks that failed (in the order they reported), the one to name: the first
    whose failure is not a lost peer, else the first."""
    for rank, (_, value) in failed.items():
        if not any(marker in last_line(value) for marker in PEER_LOST):
            return rank
    return next(iter(failed))


def raise_failure(rank: int, status: str, value: str, kind: type[RuntimeFailure]) -> None:
    """A rank's user error as it is (every rank says the same: shown once), anything else
    as ``kind`` naming the rank, with its traceback as details."""
    if status == "user_error":
        raise UserError(value)
    raise kind(f"rank {rank} failed: {last_line(value)}", value)
