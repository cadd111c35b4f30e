"""A generated folder on disk: who owns it, replacing it in one step, comparing it.

``deinfer-gen`` writes only into a folder it owns: a new or empty one, or one it wrote
before for the same spec file (its ``manifest.json`` says which). The new files go to a
hidden sibling that is swapped with the old folder by one ``renameat2(RENAME_EXCHANGE)``
— at every instant the target holds either the old or the new files — and siblings left
by a killed run are removed by the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from dsl.errors import UserError
from dsl.folders import write_atomically

MANIFEST = "manifest.json"


def check_owned(out: Path, spec_file: str, force: bool = False) -> None:
    """Refuse to replace ``out`` unless it is new, empty, or a generated folder of
    ``spec_file`` (any spec file with ``force``)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} is a file or a link, not a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    try:
        spec = json.loads((out / MANIFEST).read_text())["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"refusing to replace {out}: it is not empty and has no {MANIFEST} of a generated "
            "folder; choose a new or empty --out"
        ) from None
    theirs = spec.get("file") if isinstance(spec, dict) else None
    if theirs not in (None, spec_file) and not force:
        raise UserError(
            f"{out} holds the code of spec file {theirs!r}, not {spec_file!r} (both named "
            f"{spec.get('name')!r}); choose another --out, rename a spec, or pass --force"
        )


def stale_files(files: dict[str, str], out: Path) -> list[str]:
    """Paths under ``out`` that differ from, lack, or are not in ``files`` (bytecode
    caches are ignored: generated code is always imported from source)."""
    stale = []
    for rel, content in files.items():
        path = out / rel
        if not path.is_file() or path.read_text() != content:
            stale.append(str(path))
    if out.is_dir():
        for path in sorted(out.iterdir()):
            if path.name not in files and path.name != "__pycache__":
                stale.append(str(path))
    return stale


def cache_folder(files: dict[str, str], name: str) -> Path:
    """A folder holding ``files`` in the user's cache (``$DEINFER_CACHE`` or
    ``~/.cache/deinfer``), named by their hash: written once, reused, never temporary."""
    import hashlib

    digest = hashlib.sha256()
    for rel, content in sorted(files.items()):
        digest.update(rel.encode() + b"\0" + content.encode() + b"\0")
    root = Path(os.environ.get("DEINFER_CACHE") or Path.home() / ".cache" / "deinfer")
    folder = root / "generated" / f"{name}-{digest.hexdigest()[:16]}"
    if stale_files(files, folder):
        with contextlib.suppress(FileExistsError):
            write_atomically(files, folder)
    return folder
