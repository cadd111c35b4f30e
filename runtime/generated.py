"""Load a generated folder (``generated/<spec name>/``) as a package, by path."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


def load_generated(folder: str | Path) -> ModuleType:
    """Import ``folder/kernels.py`` (and the kernel modules it names); returns it."""
    folder = Path(folder).resolve()
    init = folder / "__init__.py"
    if not (folder / "kernels.py").is_file() or not init.is_file():
        raise FileNotFoundError(f"{folder} is not a generated folder; run deinfer-gen first")
    # One package per folder path, so two generated folders never share modules.
    name = "deinfer_generated_" + re.sub(r"\W", "_", str(folder))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.kernels")
