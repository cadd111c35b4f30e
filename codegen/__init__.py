"""Code generation: spec + plan -> Triton kernels and the registry under generated/.

The runtime calls codegen through one function, ``generated_folder``; everything else
here serves ``deinfer-gen`` (``cli``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from codegen.folder import cache_folder, stale_files
from codegen.generate import generate
from codegen.version import __version__

__all__ = ["__version__", "generated_folder"]

if TYPE_CHECKING:
    from dsl import Spec


def generated_folder(spec: Spec, root: str | Path = "generated") -> Path:
    """The folder of generated code for ``spec``: the committed ``<root>/<name>`` when it
    is current for this spec, else the same code rendered into the user's cache (by
    hash: nothing temporary to clean up after a kill)."""
    gen = generate(spec)
    committed = Path(root) / spec.name
    if committed.is_dir() and not stale_files(gen.files, committed):
        return committed
    return cache_folder(gen.files, spec.name)
