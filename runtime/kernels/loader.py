"""Load a generated folder (``generated/<spec name>/``) as a package, by path.

Generated code is always compiled from its source files: bytecode next to it (a
``__pycache__`` someone else wrote, a stray ``.pyc``) is never read, and none is written,
so what runs is exactly what ``deinfer-gen --check`` compares."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

PREFIX = "deinfer_generated_"


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str):  # type: ignore[override]
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True)


class _GeneratedFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of loaded generated packages in their folder, source only."""

    def __init__(self) -> None:
        self.folders: dict[str, Path] = {}

    def find_spec(self, fullname: str, path=None, target=None):  # type: ignore[no-untyped-def]
        package, _, module = fullname.rpartition(".")
        folder = self.folders.get(package)
        if folder is None or not (folder / f"{module}.py").is_file():
            return None
        file = str(folder / f"{module}.py")
        return importlib.util.spec_from_file_location(
            fullname, file, loader=_SourceOnlyLoader(fullname, file)
        )


def _finder() -> _GeneratedFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _GeneratedFinder):
            return finder
    finder = _GeneratedFinder()
    sys.meta_path.insert(0, finder)
    return finder


def load_generated(folder: str | Path) -> ModuleType:
    """Import ``folder/kernels.py`` (and the kernel modules it names); returns it."""
    folder = Path(folder).resolve()
    init = folder / "__init__.py"
    if not (folder / "kernels.py").is_file() or not init.is_file():
        raise FileNotFoundError(f"{folder} is not a generated folder; run deinfer-gen first")
    # One package per folder path, so two generated folders never share modules.
    name = PREFIX + re.sub(r"\W", "_", str(folder))
    if name not in sys.modules:
        _finder().folders[name] = folder
        spec = importlib.util.spec_from_file_location(
            name, init, loader=_SourceOnlyLoader(name, str(init)), submodule_search_locations=[]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.kernels")
