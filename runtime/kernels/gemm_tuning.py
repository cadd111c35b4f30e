"""Which weight shapes a start-up times, and what it already knows.

``time_cpu_gemm`` costs a few seconds per distinct weight shape (every form, every row
bucket, over hundreds of MB of weights). A uniform spec has a handful of shapes; a spec
with per-layer ranks (``deinfer decompose --allocate``) has hundreds, and timing each of
them made start-up grow with the shape count (1,087 s of tuning for 334 shapes against
18 s for 8). Two things bound it here:

- **Shape classes under a budget** (``shape_classes``): at most ``budget`` shapes are
  timed. Shapes whose sides round to the same point of a geometric grid form a class (the
  grid coarsens until the classes fit the budget); the class's representative is timed
  and every member takes its forms' timings, restricted to the forms the member itself
  can run. The products of neighbouring shapes rank their forms alike: what differs
  between forms is how they stream the weight and how they block its columns, and that
  changes slowly with the sides.
- **A persistent cache** (``TuningCache``): timings keyed by machine (CPU model, torch,
  threads, whether the native panels are built) and by shape, rows, repetitions, the
  packing choice and the bytes a pass streams; a second start times nothing it knows.
  ``DEINFER_CACHE_DIR`` (default ``$XDG_CACHE_HOME/deinfer``, else ``~/.cache/deinfer``);
  deleting the folder clears it. A file that does not parse, or that was written for
  another machine or format, is ignored with one warning line and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from runtime.kernels.cpu_gemm import (
    COLD_BYTES,
    DECODE_ROWS,
    Form,
    ShapeKey,
    Timings,
    forms_for,
    group_by_shape,
    nbytes_of,
    time_cpu_gemm,
)
from runtime.kernels.native_build import cpu_identity
from runtime.kernels.panel import panel_library

log = logging.getLogger(__name__)

# Shapes timed at most at start-up. cpu-135m and SmolLM2's uniform specs have 8 distinct
# shapes at tp 1, cpu-demo 6: a uniform spec is timed shape by shape, as before.
DEFAULT_BUDGET = 16
# Grid ratios tried, finest first (1.0: every shape its own class).
GRID_RATIOS = (1.0, 2 ** (1 / 8), 2 ** (1 / 4), 2 ** (1 / 2), 2.0, 4.0, 16.0, math.inf)
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """``DEINFER_CACHE_DIR``, else ``deinfer`` under ``XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get("DEINFER_CACHE_DIR"):
        return Path(os.environ["DEINFER_CACHE_DIR"])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "deinfer"


def _grid_point(x: int, ratio: float) -> int:
    if ratio == 1.0:
        return x
    if math.isinf(ratio):
        return 0
    return round(math.log(x) / math.log(ratio))


def shape_classes(weights: dict[ShapeKey, int], budget: int) -> dict[ShapeKey, ShapeKey]:
    """Each shape's representative: the finest grid whose classes number at most
    ``budget`` (dtypes never share a class); in a class, the shape holding the most
    bytes of the model (its time matters most), ties to the larger shape.
    ``weights``: bytes of the model's matrices per shape."""
    if budget < 1:
        raise ValueError(f"a tuning budget of {budget} shapes: it must be at least 1")
    for ratio in GRID_RATIOS:
        classes: dict[tuple, list[ShapeKey]] = {}
        for key in sorted(weights, key=lambda k: (k[0], k[1], str(k[2]))):
            k, n, dtype = key
            point = (_grid_point(k, ratio), _grid_point(n, ratio), dtype)
            classes.setdefault(point, []).append(key)
        if len(classes) <= budget:
            break
    chosen = {}
    for members in classes.values():
        rep = max(members, key=lambda m: (weights[m], m[0] * m[1]))
        chosen.update(dict.fromkeys(members, rep))
    return chosen


def machine_identity() -> dict[str, object]:
    """What a timing depends on besides the shape: the CPU (model and feature flags),
    torch, the threads, whether the native panel kernel is built."""
    return {
        "format": CACHE_FORMAT,
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "panels": panel_library() is not None,
    }


@dataclass
class TuningCache:
    """Timings by shape for one machine identity, in one JSON file under ``root``."""

    root: Path
    identity: dict[str, object] = field(default_factory=machine_identity)
    entries: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()
        return self.root / f"cpu-gemm-{digest[:16]}.json"

    def load(self) -> TuningCache:
        """The file's entries where it holds this identity's; else none, with a warning."""
        self.entries = self._read() or {}
        return self

    def _read(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("tuning cache %s unreadable (%s): ignored", self.path, e)
            return None
        if not isinstance(data, dict) or data.get("identity") != self.identity:
            log.warning("tuning cache %s is for another machine or format: ignored", self.path)
            return None
        entries = data.get("entries")
        if not isinstance(entries, dict) or not all(_valid(v) for v in entries.values()):
            log.warning("tuning cache %s has malformed entries: ignored", self.path)
            return None
        return entries

    def save(self) -> None:
        """Merged with what another process wrote meanwhile, then replaced atomically (a
        reader sees the old file or the new one, never half of one)."""
        merged = {**(self._read() or {}), **self.entries}
        self.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"identity": self.identity, "entries": merged}, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".cpu-gemm-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
        self.entries = merged


def _valid(entry: object) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(forms, dict) and all(isinstance(t, (int, float)) for t in forms.values())
        for forms in entry.values()
    )


@dataclass
class TuningReport:
    """What one start-up's tuning did: this rank's shapes; the classes, shapes timed and
    cache hits of its machine (whose ranks tune together); the shapes this rank timed."""

    shapes: int = 0
    classes: int = 0
    timed: int = 0
    cached: int = 0
    timed_here: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """e.g. "tuned 288 shapes in 20.1 s: 16 timed (6 by this rank), 0 from the cache"."""
        if not self.shapes:
            return "untuned"
        share = f" ({self.timed_here} by this rank)" if self.timed_here != self.timed else ""
        return (
            f"tuned {self.shapes} shape{'s' if self.shapes != 1 else ''} in "
            f"{self.seconds:.1f} s: {self.timed} timed{share}, {self.cached} from the cache"
        )


class TuningProgress:
    """Start-up's tuning as it goes, on stderr: a bar on a terminal, a line per shape in
    a log."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self.bar is None:
                self.bar = tqdm(total=total, desc="tuning products", unit="shape", leave=False)
            self.bar.update(1)
            if done == total:
                self.bar.close()
        else:
            print(f"tuning products: {done}/{total} shapes timed", file=sys.stderr, flush=True)


def tune_cpu_gemm(
    matrices: Iterable[torch.Tensor],
    budget: int = DEFAULT_BUDGET,
    cache: TuningCache | None = None,
    packing: bool = True,
    rows: tuple[int, ...] = DECODE_ROWS,
    # The median of 3 passes, not 2 (their mean): with 2, one slow pass (the other rank
    # timing its shapes on the same memory bus) chose forms that made two engines of
    # the same plan decode 118.5 and 151.2 tok/s (cpu-demo at param_count 40 %, tp 2,
    # batch 16, one bench run, 2026-12-06).
    reps: int = 3,
    progress: Callable[[int, int], None] | None = None,
    group: dist.ProcessGroup | None = None,
    streamed_besides: int = 0,
) -> tuple[Timings, TuningReport]:
    """``time_cpu_gemm``'s timings for every shape of ``matrices``, having timed at most
    ``budget`` representatives and none that ``cache`` holds. ``progress(done, total)``
    is called after each shape this rank timed.

    The ranks of ``group`` that run on one machine tune together: the classes are made
    over all their shapes, the shapes to time are dealt out among them, and every rank
    gets every timing. A host's start-up then times at most ``budget`` shapes however
    many ranks it runs, and ranks holding equal shapes choose equal forms.
    ``streamed_besides``: bytes of a rank's matrices its step streams but that are not
    tuned here (the native decode blocks' panels); they count toward the bytes a timing
    pass reads, as they push the tuned ones out of the caches in a real step (timed
    alone, the 135M model's 113 MB LM head chose MKL's call at one row, 3.8 ms in a
    step, against the panels' 2.75)."""
    groups = group_by_shape(matrices)
    nbytes = {key: sum(map(nbytes_of, mats)) for key, mats in groups.items()}
    host = _HostRanks.of(group)
    host_bytes, host_cold = host.merged_bytes(nbytes)
    rep_of = shape_classes(host_bytes, budget) if host_bytes else {}
    timed = sorted(set(rep_of.values()), key=_order)
    keys = _EntryKeys(rows, reps, packing, cold=min(COLD_BYTES, host_cold + streamed_besides))
    known = _cached(cache, keys, {key: forms_for(_like(key), packing) for key in timed})
    missing = host.union([key for key in timed if key not in known])
    mine = missing[host.index :: host.size]
    entries = {}
    for i, key in enumerate(mine):
        sample = groups.get(key) or [_synthetic(key)]
        own = time_cpu_gemm(sample, rows, reps, packing=packing, target_bytes=keys.cold)[key]
        entries[keys(key)] = {str(r): {f.name: t for f, t in fs.items()} for r, fs in own.items()}
        if progress is not None:
            progress(i + 1, len(mine))
    entries = host.merged_entries(entries)
    for key in missing:
        known[key] = _from_entry(entries[keys(key)])
    report = TuningReport(
        len(groups), len(timed), len(missing), len(timed) - len(missing), len(mine)
    )
    if cache is not None and missing and host.index == 0:
        cache.entries.update(entries)
        try:
            cache.save()
        except OSError as e:
            log.warning("tuning cache %s not written (%s)", cache.path, e)
    return {key: _as_member(known[rep_of[key]], groups[key][0], packing) for key in groups}, report


def _order(key: ShapeKey) -> tuple[int, int, str]:
    return key[0], key[1], str(key[2])


def _like(key: ShapeKey) -> torch.Tensor:
    """An (unset) matrix of the shape, stored as the dynamic path stores its weights: what
    ``forms_for`` reads of a shape."""
    k, n, dtype = key
    return torch.empty(n, k, dtype=dtype).t()


def _synthetic(key: ShapeKey) -> torch.Tensor:
    """A matrix of a shape another rank of this machine holds: a product's time depends on
    the shape, the dtype and the layout, not on the values."""
    k, n, dtype = key
    return torch.randn(n, k).to(dtype).t()


@dataclass(frozen=True)
class _HostRanks:
    """The ranks of a group that run on this machine (same host name and machine
    identity), and this rank's place among them. Every rank of the group takes part in
    each exchange, so the calls stay collective across machines."""

    group: dist.ProcessGroup | None
    world: int
    members: tuple[int, ...]  # group ranks on this machine
    index: int  # this rank's place in ``members``

    @property
    def size(self) -> int:
        return len(self.members)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> _HostRanks:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return cls(None, 1, (0,), 0)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        machines = cls._gather(group, world, (socket.gethostname(), machine_identity()))
        members = tuple(r for r in range(world) if machines[r] == machines[rank])
        return cls(group, world, members, members.index(rank))

    @staticmethod
    def _gather(group: dist.ProcessGroup | None, world: int, item: object) -> list:
        out: list[object] = [None] * world
        dist.all_gather_object(out, item, group=group)
        return out

    def _from_host(self, item: object) -> list:
        if self.world == 1:
            return [item]
        everyone = self._gather(self.group, self.world, item)
        return [everyone[r] for r in self.members]

    def merged_bytes(self, nbytes: dict[ShapeKey, int]) -> tuple[dict[ShapeKey, int], int]:
        """The bytes per shape over this machine's ranks, and the most one rank holds
        (what one pass of a rank's decode step streams)."""
        merged: dict[ShapeKey, int] = {}
        per_rank = self._from_host(nbytes)
        for theirs in per_rank:
            for key, size in theirs.items():
                merged[key] = merged.get(key, 0) + size
        return merged, max(sum(theirs.values()) for theirs in per_rank)

    def union(self, keys: list[ShapeKey]) -> list[ShapeKey]:
        """The shapes any rank of this machine misses (their caches may differ)."""
        return sorted({k for theirs in self._from_host(keys) for k in theirs}, key=_order)

    def merged_entries(self, entries: dict[str, dict]) -> dict[str, dict]:
        return {k: v for theirs in self._from_host(entries) for k, v in theirs.items()}


@dataclass(frozen=True)
class _EntryKeys:
    """A shape's key in the cache, with everything else its timing depends on: the rows
    timed, the repetitions, whether reordering forms were among the candidates, and the
    bytes one pass streams (a model that fits in the caches is timed from them)."""

    rows: tuple[int, ...]
    reps: int
    packing: bool
    cold: int

    def __call__(self, key: ShapeKey) -> str:
        k, n, dtype = key
        rows = ",".join(map(str, self.rows))
        return f"{k}x{n} {dtype} rows={rows} reps={self.reps} pack={self.packing} cold={self.cold}"


def _cached(
    cache: TuningCache | None, keys: _EntryKeys, wanted: dict[ShapeKey, list[Form]]
) -> dict[ShapeKey, dict[int, dict[Form, float]]]:
    """The timings ``cache`` holds of the ``wanted`` shapes, where they cover every row
    and every form the shape can run."""
    found = {}
    for key, forms in wanted.items():
        entry = cache.entries.get(keys(key)) if cache is not None else None
        names = {f.name for f in forms}
        if entry is None or not all(names <= set(entry.get(str(r), {})) for r in keys.rows):
            continue
        found[key] = _from_entry({str(r): entry[str(r)] for r in keys.rows})
    return found


def _from_entry(entry: dict[str, dict[str, float]]) -> dict[int, dict[Form, float]]:
    """A cache entry's timings, by row count and form."""
    return {int(r): {_form_named(f): t for f, t in fs.items()} for r, fs in entry.items()}


def _form_named(name: str) -> Form:
    """The form whose ``Form.name`` this is (the cache stores names)."""
    if name.startswith("blocked"):
        return Form("blocked", int(name.removeprefix("blocked")))
    return Form(name)


def _as_member(
    per_rows: dict[int, dict[Form, float]], b: torch.Tensor, packing: bool
) -> dict[int, dict[Form, float]]:
    """The representative's timings of the forms that member b can run."""
    allowed = set(forms_for(b, packing))
    return {r: {f: t for f, t in fs.items() if f in allowed} for r, fs in per_rows.items()}
