"""A generated folder on disk: who owns it, replacing it in one step, comparing it.

``deinfer-gen`` writes only into a folder it owns: a new or empty one, or one it wrote
before for the same spec file (its ``manifest.json`` says which). The new files go to a
hidden sibling that is swapped with the old folder by one ``renameat2(RENAME_EXCHANGE)``
— at every instant the target holds either the old or the new files — and siblings left
by a killed run are removed by the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from dsl.errors import UserError

MANIFEST = "manifest.json"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one system call; False where the system cannot."""
    rename2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename2 is None:
        return False
    rc = rename2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove the hidden siblings of ``out`` left by runs that were killed (their process
    is gone); put an old folder back if a killed run left ``out`` missing."""
    if not out.parent.is_dir():
        return
    for sibling in out.parent.glob(f".{out.name}.*-*"):
        kind, _, rest = sibling.name[len(out.name) + 2 :].partition("-")
        pid = rest.split("-")[0]
        if kind not in ("new", "old") or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if kind == "old" and not out.exists():
            sibling.rename(out)  # the fallback swap was cut between its two renames
        else:
            shutil.rmtree(sibling, ignore_errors=True)


def new_sibling(out: Path) -> Path:
    """A fresh hidden folder beside ``out``, named so that ``clean_stale`` can tell, once
    this process is gone, that nobody is writing it any more."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.new-{os.getpid()}-", dir=out.parent))


def swap_in(new: Path, out: Path) -> None:
    """Make the complete folder ``new`` the folder ``out`` and remove the old one: one
    ``renameat2`` exchange where the system has it (``out`` always holds the old or the
    new files), else two renames that ``clean_stale`` repairs if cut between them."""
    if not out.exists():
        new.rename(out)
    elif _exchange(new, out):
        shutil.rmtree(new)  # it now holds the old files
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        old.rmdir()
        out.rename(old)
        new.rename(out)
        shutil.rmtree(old)


def write_atomically(files: dict[str, str], out: Path) -> None:
    """Write ``files`` as the whole content of folder ``out``, never half-written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    new = new_sibling(out)
    try:
        for rel, content in files.items():
            (new / rel).write_text(content)
        swap_in(new, out)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


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
