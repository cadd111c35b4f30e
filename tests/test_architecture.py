"""The shape of the house, checked: imports go one way between the layers, the spec
is parsed once per process, and no file or function outgrows what a reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO, SPECS

# Lowest first: a module may import modules of its own layer or of layers before it.
LAYERS = (
    "dsl",
    "tune.store",
    "tune.profiles",  # the cost model's leaves, below the runtime that chooses its layout
    "tune.cost_model",
    "tune.layout",
    "codegen",
    "runtime",  # its rooms, in order:
    "runtime.kernels",
    "runtime.dist",
    "runtime.model",
    "runtime.engine",
    "runtime.serve",
    "runtime.tools",
    "compress",
    "tune",
    "bench",
    "cli",
)
PACKAGES = ("dsl", "codegen", "runtime", "compress", "tune", "bench", "cli")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def _python_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _project_imports(path: Path) -> list[str]:
    return [m for m in _imports(path) if m.split(".")[0] in PACKAGES]


def test_imports_go_one_way():
    backwards = []
    for path in _python_files(*PACKAGES):
        module = _module_name(path)
        for imported in _project_imports(path):
            if _layer(imported) > _layer(module):
                backwards.append(f"{module} imports {imported}")
    assert backwards == []


def _module_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports, at the top or inside a
    function (``from pkg import name`` counts ``pkg.name`` when that is a module)."""
    paths = {_module_name(p): p for p in _python_files(*PACKAGES)}

    def owner(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [f"{node.module}.{a.name}" for a in node.names]
                found |= {n if n in paths else owner(node.module) for n in named}
        graph[module] = found - {None, module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_module_import_cycles_counting_imports_inside_functions():
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_runtime_calls_codegen_through_one_function():
    for path in _python_files("runtime"):
        for imported in _project_imports(path):
            if imported.split(".")[0] == "codegen":
                assert imported == "codegen", f"{_module_name(path)} imports {imported}"
                assert "import generated_folder" in path.read_text()


def test_the_tuned_config_store_is_a_leaf():
    imported = _project_imports(REPO / "tune" / "store.py")
    assert all(m.split(".")[0] == "dsl" for m in imported), imported


def test_dsl_never_imports_torch():
    for path in _python_files("dsl"):
        assert not [m for m in _imports(path) if m.split(".")[0] in ("torch", "triton")], path


def test_generated_code_uses_only_the_kernel_primitives():
    """Generated modules import triton and ``runtime.kernels`` (launch helpers and
    reference implementations), never the engine."""
    for path in sorted((REPO / "generated").rglob("*.py")):
        for imported in _imports(path):
            if imported.split(".")[0] in PACKAGES:
                assert imported == "runtime.kernels", f"{path}: {imported}"


def test_the_layer_rule_catches_a_backwards_import():
    assert _layer("dsl.plan") < _layer("codegen.generate") < _layer("runtime.engine.llm")
    assert _layer("runtime.engine.llm") < _layer("tune.calibrate") < _layer("cli.run")
    assert _layer("tune.store") < _layer("codegen.families.context")
    assert _layer("runtime.model.layers") < _layer("runtime.engine.kv_cache")


@pytest.mark.parametrize("top", [*PACKAGES, "tests"])
def test_files_and_functions_stay_small(top):
    too_long = []
    for path in _python_files(top):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}::{node.name}: {length} lines")
    assert too_long == []


def test_the_spec_is_parsed_once_when_an_engine_starts(tmp_path, monkeypatch):
    """``LLM(path, tp=...)`` reads the file once; the tp replacement, the plan, the
    generated folder and the rank (tp 1: in this process) all share that ``Spec``."""
    import dsl.load
    from dsl import load_spec, with_tp
    from runtime.engine import LLM, SamplingParams
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec_path = SPECS / "tiny-llama.yaml"
    checkpoint = write_random_checkpoint(with_tp(load_spec(spec_path), 1), tmp_path / "ckpt", 0)
    calls = []
    parse = dsl.load.SpecParser.spec

    def counting(self, raw, default_name):
        calls.append(default_name)
        return parse(self, raw, default_name)

    monkeypatch.setattr(dsl.load.SpecParser, "spec", counting)
    with LLM(spec_path, checkpoint, tp=1, mode="dense", kv_cache="dense") as llm:
        assert calls == ["tiny-llama"]
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2
    assert calls == ["tiny-llama"]
