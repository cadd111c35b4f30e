"""Folders replaced whole, never half-written: the new content is built in a hidden
sibling (``new_sibling``) and swapped in by one ``renameat2(RENAME_EXCHANGE)`` — at every
instant the target holds either the old or the new files — and siblings left by a writer
that was killed are removed by the next one (``clean_stale``). ``deinfer-gen``
(``codegen.folder``) and the checkpoint writers (``compress.output``) use
it; each decides on its own which folders it may replace."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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
    new files), else two renames that ``clean_stale`` repairs if cut between them.

    ``out`` is not tested for first: a writer that found it missing could lose the race
    to another one writing it at the same moment (the ranks of a test rendering the same
    cached code: 10 of 200 rounds of 4 such writers failed with "Directory not empty").
    The rename is the test; the writer that finds ``out`` there exchanges it instead."""
    try:
        new.rename(out)  # out missing (or an empty folder)
        return
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    if _exchange(new, out):
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
