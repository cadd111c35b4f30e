"""Output folders of the checkpoint writers (``deinfer decompose``, ``import``,
``fidelity``), written whole or not at all, and only where they may be.

The rule ``deinfer-gen`` follows for generated code: a writer
replaces only a new or empty folder, or one that the same tool wrote (its
``deinfer-output.json`` says which), anything else only with ``--force`` — and never the
source it reads, a folder holding that source, or the folder the user stands in. The
new files go to a hidden sibling swapped in with one rename exchange once complete;
siblings of writers that were killed are removed by the next run; a full or read-only
disk is one line, with nothing half-written left."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsl.errors import RuntimeFailure, UserError
from dsl.folders import clean_stale, new_sibling, swap_in

FORMAT = "deinfer-lowrank-v1"
OWNER_FILE = "deinfer-output.json"


class OutputError(RuntimeFailure):
    """An output could not be written (disk full, read-only, no permission); nothing
    half-written is left."""


def _owner(folder: Path) -> str | None:
    try:
        owner = json.loads((folder / OWNER_FILE).read_text()).get("written_by")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def check_output_folder(
    out: Path, tool: str, sources: Sequence[Path] = (), force: bool = False
) -> None:
    """Refuse, in one line, an ``--out`` that ``tool`` may not replace."""
    where = out.resolve()
    for source in sources:
        held = Path(source).resolve()
        if held == where or where in held.parents:
            raise UserError(
                f"--out {out} {'is' if held == where else 'holds'} the source {source}; "
                "a writer never replaces what it reads: choose another --out"
            )
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise UserError(f"--out {out} holds the current folder; choose a new folder for it")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} is a file or a link, not a folder")
    if not out.exists() or not any(out.iterdir()) or force:
        return
    owner = _owner(out)
    if owner == tool:
        return
    made_by = f"was written by {owner}" if owner else f"has no {OWNER_FILE} of {tool}"
    raise UserError(
        f"refusing to replace {out}: it is not empty and {made_by}; choose a new or empty "
        "--out, or pass --force"
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    found = re.search(r"I/O error: (.*?)(?: \(os error \d+\))?$", str(exc))
    return found.group(1) if found else str(exc).splitlines()[0]


@contextmanager
def staged_folder(
    target: Path, tool: str, sources: Sequence[Path] = (), force: bool = False
) -> Iterator[Path]:
    """A fresh folder beside ``target`` to write into; swapped in for ``target`` (with
    its owner file) once the block ends, removed if it raises."""
    target = Path(target)
    check_output_folder(target, tool, sources, force)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(target)
        tmp = new_sibling(target)
        tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {_reason(exc)}") from None
    try:
        yield tmp
        record = {"written_by": tool, "sources": [str(s) for s in sources]}
        (tmp / OWNER_FILE).write_text(json.dumps(record, indent=2) + "\n")
        swap_in(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write {target}: {_reason(exc)} (nothing written)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors`` ``save_file``, its I/O failures raised as ``OSError`` (safetensors
    raises its own error type, with the system's reason inside the text)."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except Exception as exc:
        if "I/O error" not in str(exc):
            raise
        raise OSError(_reason(exc)) from None


class DecomposedWriter:
    """Writes a decomposed checkpoint folder one shard at a time (one per layer, then
    the rest), with the safetensors index and config.json."""

    def __init__(self, folder: Path, n_files: int, dtype: torch.dtype) -> None:
        self.folder, self.n_files, self.dtype = folder, n_files, dtype
        self.weight_map: dict[str, str] = {}
        self._next = 1

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        name = f"model-{self._next:05d}-of-{self.n_files:05d}.safetensors"
        self._next += 1
        save_tensors(
            {k: v.to(self.dtype).contiguous() for k, v in tensors.items()}, self.folder / name
        )
        self.weight_map.update({k: name for k in tensors})

    def finish(self, config: dict[str, Any]) -> None:
        (self.folder / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {"format": FORMAT},
                    "weight_map": dict(sorted(self.weight_map.items())),
                },
                indent=2,
            )
        )
        (self.folder / "config.json").write_text(json.dumps(config, indent=2))
