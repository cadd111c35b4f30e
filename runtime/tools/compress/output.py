"""Output folders written whole or not at all: everything goes to a hidden sibling
folder that replaces the target only when complete."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FORMAT = "deinfer-lowrank-v1"


@contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A fresh folder beside ``target``; renamed to ``target`` (replacing it) on success,
    removed on any failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
        save_file(
            {k: v.to(self.dtype).contiguous() for k, v in tensors.items()},
            self.folder / name,
            metadata={"format": "pt"},
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
