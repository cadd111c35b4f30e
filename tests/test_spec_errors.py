"""Invalid specs: SpecError names the YAML path; the CLI prints one line, exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsl import SpecError, load_spec, parse_spec
from tests.conftest import REPO, SPECS

TINY = yaml.safe_load((SPECS / "tiny-llama.yaml").read_text())


def _with(mutate) -> str:
    raw = yaml.safe_load(yaml.safe_dump(TINY))
    mutate(raw)
    return yaml.safe_dump(raw)


def _drop_hidden(raw):
    del raw["model"]["hidden_size"]


def _bad_override_rank(raw):
    raw["decomposition"]["overrides"] = [
        {"layers": [0], "ranks": {"q": 3}},
        {"layers": [2], "ranks": {"k": 0}},
    ]


CASES = [
    ("missing required field", _drop_hidden, "model.hidden_size", "missing required field"),
    ("unknown key", lambda r: r["model"].update(hiden_size=3), "model.hiden_size", "unknown key"),
    (
        "zero rank",
        lambda r: r["decomposition"]["ranks"].update(q=0),
        "decomposition.ranks.q",
        "must be positive",
    ),
    (
        "negative rank",
        lambda r: r["decomposition"]["ranks"].update(o=-4),
        "decomposition.ranks.o",
        "must be positive",
    ),
    (
        "rank above min(in, out)",
        lambda r: r["decomposition"]["ranks"].update(k=33),
        "decomposition.ranks.k",
        "exceeds min(in, out) = min(64, 32) = 32",
    ),
    ("override path", _bad_override_rank, "decomposition.overrides[1].ranks.k", "must be positive"),
    (
        "tp vs q heads",
        lambda r: r["parallel"].update(tp=3),
        "parallel.tp",
        "num_heads 4 is not divisible by tp 3",
    ),
    (
        "tp vs kv heads",
        lambda r: (
            r["model"].update(num_heads=6, num_kv_heads=2, head_dim=8) or r["parallel"].update(tp=3)
        ),
        "parallel.tp",
        "num_kv_heads 2 and tp 3",
    ),
    (
        "a list instead of a mapping",
        lambda r: r.update(model=[1, 2]),
        "model",
        "expected a mapping, found a list",
    ),
    (
        "string rank",
        lambda r: r["decomposition"]["ranks"].update(v="12"),
        "decomposition.ranks.v",
        "expected a positive integer rank",
    ),
    (
        "bool for int",
        lambda r: r["model"].update(num_layers=True),
        "model.num_layers",
        "expected an integer",
    ),
    (
        "matrix of another family",
        lambda r: r["decomposition"]["ranks"].update(fc1=3),
        "decomposition.ranks.fc1",
        "unknown key",
    ),
    (
        "layer out of range",
        lambda r: r["decomposition"]["overrides"][0].update(layers=["1-7"]),
        "decomposition.overrides[0].layers[0]",
        "layer out of range",
    ),
    ("bad name", lambda r: r.update(name="x'); import os; ('"), "name", "must match"),
    (
        "graph sizes unsorted",
        lambda r: r["runtime"].update(cuda_graph_batch_sizes=[4, 2]),
        "runtime.cuda_graph_batch_sizes",
        "strictly increasing",
    ),
]


@pytest.mark.parametrize("label,mutate,path,reason", CASES, ids=[c[0] for c in CASES])
def test_spec_error_names_path_and_reason(label, mutate, path, reason):
    with pytest.raises(SpecError) as info:
        parse_spec(_with(mutate))
    assert info.value.path == path, str(info.value)
    assert reason in info.value.reason
    assert str(info.value).startswith(path + ": ")


def test_top_level_list_and_python_tag_and_duplicates():
    with pytest.raises(SpecError, match="expected a mapping, found a list"):
        parse_spec("- 1\n- 2\n")
    with pytest.raises(SpecError, match="YAML construct not allowed"):
        parse_spec("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="duplicate key 'model'"):
        parse_spec("model: {}\nmodel: {}\n")


def _write_bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    big = tmp / "big.yaml"
    with big.open("wb") as f:
        f.write(b"# " + b"x" * (20 * 1024 * 1024) + b"\n")
    latin = tmp / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    tag = tmp / "tag.yaml"
    tag.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    lst = tmp / "list.yaml"
    lst.write_text("- a\n- b\n")
    unknown = tmp / "unknown.yaml"
    unknown.write_text(_with(lambda r: r.update(paralel={"tp": 2})))
    return {
        "20 MB file": (big, "more than the"),
        "non-UTF-8": (latin, "not UTF-8"),
        "python tag": (tag, "YAML construct not allowed"),
        "list": (lst, "expected a mapping, found a list"),
        "unknown key": (unknown, "paralel: unknown key"),
        "missing file": (tmp / "nope.yaml", "spec file not found"),
    }


def test_loader_rejects_bad_files(tmp_path):
    for label, (path, message) in _write_bad_files(tmp_path).items():
        with pytest.raises(SpecError, match=message):
            load_spec(path)
        assert label


def test_cli_prints_one_line_and_exits_2(tmp_path):
    cases = _write_bad_files(tmp_path)
    missing = tmp_path / "missing.yaml"
    missing.write_text(_with(_drop_hidden))
    cases["missing field"] = (missing, "model.hidden_size: missing required field")
    for label, (path, message) in cases.items():
        proc = subprocess.run(
            [sys.executable, "-m", "cli.main", "plan", str(path)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert proc.returncode == 2, (label, proc.stderr)
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (label, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_cli_tp_override_is_validated():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "plan",
            str(SPECS / "tiny-llama.yaml"),
            "--tp",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: parallel.tp: num_heads 4 is not divisible by tp 3"
