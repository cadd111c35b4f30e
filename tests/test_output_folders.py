"""Checkpoint writers (``deinfer decompose``, ``import``, ``fidelity``) write only where
they may, whole or not at all: a folder holding someone else's files, the source, a
folder holding the source or the current folder is refused in one line with nothing
touched; a killed writer never leaves the target missing or mixed, and what it left is
removed by the next run; a full or read-only disk is one line, with nothing left."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli.main import main as cli
from compress.decompose import model_section
from compress.output import OWNER_FILE
from dsl import load_spec
from dsl.errors import UserError
from runtime.model.checkpoint import CheckpointReader, validate
from tests.conftest import REPO
from tests.hardening import one_line
from tests.hf_models import TINY_LLAMA, build_hf

RUNTIME = {"dtype": "float32", "max_batch_size": 2, "max_seq_len": 32, "block_size": 4}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, Path]:
    """(dense transformers folder, spec of a 40% cut)."""
    work = tmp_path_factory.mktemp("outputs")
    build_hf("llama", TINY_LLAMA, seed=5).save_pretrained(work / "dense")
    config = json.loads((work / "dense" / "config.json").read_text())
    raw = {"name": "tiny-out", "model": model_section(config), "decomposition": {"ratio": 0.4}}
    spec = work / "tiny-out.yaml"
    spec.write_text(yaml.safe_dump(raw | {"parallel": {"tp": 1}, "runtime": RUNTIME}))
    return work / "dense", spec


def _decompose(dense: Path, spec: Path, out: Path | str, *extra: str) -> int:
    args = ["decompose", "--model", str(dense), "--spec", str(spec), "--out", str(out)]
    return cli([*args, "--quiet", *extra])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_folder_of_someone_elses_files_is_refused_and_untouched(dense, tmp_path, capsys):
    model, spec = dense
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert _decompose(model, spec, mine) == 2
    assert "refusing to replace" in one_line(capsys.readouterr().err)
    assert _snapshot(mine) == {"notes.txt": b"keep"}
    assert _decompose(model, spec, mine, "--force") == 0  # asked for: replaced
    assert json.loads((mine / OWNER_FILE).read_text())["written_by"] == "deinfer decompose"
    assert not (mine / "notes.txt").exists()


@pytest.mark.parametrize("where", ["model", "parent of model", "cwd", "parent of cwd"])
def test_the_source_and_the_current_folder_are_never_replaced(
    dense, where, tmp_path, capsys, monkeypatch
):
    model, spec = dense
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("keep")
    monkeypatch.chdir(here)
    before = _snapshot(model.parent), _snapshot(tmp_path)
    out = {"model": model, "parent of model": model.parent, "cwd": ".", "parent of cwd": ".."}
    assert _decompose(model, spec, out[where], "--force") == 2
    message = one_line(capsys.readouterr().err)
    assert ("the source" in message) if "model" in where else ("current folder" in message)
    assert (_snapshot(model.parent), _snapshot(tmp_path)) == before


def test_import_refuses_the_same_way(dense, tmp_path, capsys):
    model, _ = dense
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("keep")
    args = ["import", "--format", "svd-llm", str(model), "--spec-out", str(tmp_path / "s.yaml")]
    assert cli([*args, "--out", str(mine)]) == 2
    assert "refusing to replace" in one_line(capsys.readouterr().err)
    assert cli(["import", "--format", "gguf", str(model), "--out", str(model), "--force"]) == 2
    assert "is the source" in one_line(capsys.readouterr().err)
    assert _snapshot(mine) == {"a.txt": b"keep"}


def test_fidelity_checks_its_folders_before_any_work(dense, tmp_path, capsys):
    model, _ = dense
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("keep")
    start = time.monotonic()
    assert cli(["fidelity", "--model", str(model), "--out", str(mine), "--quiet"]) == 2
    assert "refusing to replace" in one_line(capsys.readouterr().err)
    args = ["fidelity", "--model", str(model), "--out", str(tmp_path / "t"), "--quiet"]
    assert cli([*args, "--keep", str(tmp_path / "t" / "k")]) == 2
    assert "must lie outside --out" in one_line(capsys.readouterr().err)
    assert time.monotonic() - start < 10 and _snapshot(mine) == {"a.txt": b"keep"}


def test_killed_writers_leave_the_target_whole_and_the_next_run_cleans_up(dense, tmp_path):
    """Two specs (different ranks) decomposed in turn into one folder and killed at
    random moments: the folder always holds one complete checkpoint (the manifest last
    written matches its index), and no hidden sibling survives the next run."""
    model, spec = dense
    other = tmp_path / "other.yaml"
    other.write_text(spec.read_text().replace("ratio: 0.4", "ratio: 0.6"))
    out = tmp_path / "ckpt"
    assert _decompose(model, spec, out) == 0
    rng = random.Random(1)
    for i in range(6):
        which = (spec, other)[i % 2]
        cmd = [sys.executable, "-m", "cli.main", "decompose", "--model", str(model)]
        cmd += ["--spec", str(which), "--out", str(out), "--quiet"]
        proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        time.sleep(rng.uniform(1.0, 6.0))
        proc.kill()
        proc.wait()
        assert (out / OWNER_FILE).is_file() and sum(map(_holds(out), (spec, other))) == 1
    assert _decompose(model, other, out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "other.yaml"]


def _holds(out: Path):
    """Whether ``out`` is a complete checkpoint of a spec (every tensor, every shape)."""

    def check(spec: Path) -> bool:
        try:
            validate(CheckpointReader(out), load_spec(spec))
        except UserError:
            return False
        return True

    return check


@contextlib.contextmanager
def _mounted(path: Path, options: str):
    path.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False)
    if made.returncode != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small or read-only tmpfs")
@pytest.mark.parametrize(
    "options,words", [("size=16k", "No space left on device"), ("ro", "Read-only file system")]
)
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(
    dense, tmp_path, capsys, options, words
):
    model, spec = dense
    with _mounted(tmp_path / "disk", options) as disk:
        assert _decompose(model, spec, disk / "ckpt") == 1
        message = one_line(capsys.readouterr().err)
        assert message.startswith("error: cannot write") and words in message
        assert list(disk.iterdir()) == []
