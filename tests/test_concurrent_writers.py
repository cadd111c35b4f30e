"""Writers of the same folder at the same moment (the ranks of one machine rendering the
same cached code) all succeed, and the folder holds one complete copy."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from dsl.folders import write_atomically

WRITERS = 4
ROUNDS = 100
FILES = {f"part{i}.py": f"PART = {i}\n" for i in range(20)}


def _write_rounds(barrier, root: str, errors) -> None:
    for r in range(ROUNDS):
        barrier.wait()  # every writer finds the round's folder missing, then renames
        try:
            write_atomically(FILES, Path(root) / f"round-{r}")
        except Exception as exc:  # reported to the test, which names it
            errors.put(f"round {r}: {exc!r}")


def test_writers_racing_to_a_missing_folder_all_succeed(tmp_path):
    # Before the fix (``dsl.folders.swap_in`` tested for the folder, then renamed) 10 of
    # 200 rounds failed here with "Directory not empty".
    ctx = mp.get_context("spawn")
    barrier, errors = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [
        ctx.Process(target=_write_rounds, args=(barrier, str(tmp_path), errors))
        for _ in range(WRITERS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
    assert sorted(os.listdir(tmp_path)) == sorted(f"round-{r}" for r in range(ROUNDS))
    for r in range(ROUNDS):
        folder = tmp_path / f"round-{r}"
        assert {p.name: p.read_text() for p in folder.iterdir()} == FILES
