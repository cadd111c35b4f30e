"""Ranks and drivers: a stopped, killed or signalled rank or driver is named in one line,
with the exit status a shell expects, and leaves no process and no folder behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from runtime.dist.launcher import WorkerError, free_port
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from tests.conftest import REPO
from tests.hardening import hardening_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hardening_model(tmp_path_factory.mktemp("processes"))


# --- ranks and drivers ---------------------------------------------------------------------


def test_a_stopped_rank_is_named_within_30_s(model):
    with LLM(*model, tp=2) as engine:
        pid = engine.workers.procs[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(WorkerError, match=r"^rank 1 stopped answering"):
                engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
            assert time.monotonic() - start < 30
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_killed_rank_is_the_one_named(model):
    with LLM(*model, tp=2) as engine:
        engine.workers.procs[1].kill()
        with pytest.raises(WorkerError, match=r"^rank 1 died \(exit code -9\)"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))


# ``deinfer`` as a terminal starts it, with SIGINT at its default: a suite run in the
# background (``nohup ... &``) hands every child an ignored SIGINT, which Python keeps.
AS_FROM_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('cli.main', run_name='__main__', alter_sys=True)"
)


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def _wait_empty(sid: int, seconds: float = 10.0) -> list[int]:
    end = time.monotonic() + seconds
    while (left := _session(sid)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def _long_run(model) -> subprocess.Popen:
    """``deinfer run`` at tp 2 generating 470 tokens, once its ranks are up and busy."""
    spec, ckpt = model
    args = ["--spec", str(spec), "--checkpoint", str(ckpt), "--tp", "2"]
    proc = _cli("run", *args, "--prompt", "1,2", "--max-tokens", "470")
    end = time.monotonic() + 120
    while len(_session(proc.pid)) < 3 and time.monotonic() < end:
        time.sleep(0.2)
    time.sleep(1.0)
    return proc


def _temp_entries() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("deinfer")}


def test_sigkill_to_the_driver_leaves_no_process_and_no_folder(model):
    spec, ckpt = model
    before = _temp_entries()
    port = free_port()
    args = ["--spec", str(spec), "--checkpoint", str(ckpt), "--tp", "2", "--port", str(port)]
    proc = _cli("serve", *args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        time.sleep(0.3)
    assert len(_session(proc.pid)) >= 3  # the driver and two ranks
    proc.kill()
    proc.communicate()
    assert _wait_empty(proc.pid) == []
    assert _temp_entries() <= before


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated")])
def test_a_signal_to_the_driver_ends_inone_line(model, sig, code, word):
    before = _temp_entries()
    proc = _long_run(model)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == word and "Traceback" not in err
    assert _wait_empty(proc.pid) == []
    assert _temp_entries() <= before


def test_ctrl_c_reaches_every_process_and_ends_inone_line(model):
    proc = _long_run(model)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    _, err = proc.communicate(timeout=60)
    # 130, or killed by SIGINT (which a shell also reports as 130): CPython ends that way
    # when the interrupt landed inside an extension's embedded Python (torch's import).
    assert proc.returncode in (130, -signal.SIGINT), err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert _wait_empty(proc.pid) == []


def test_a_ranks_clean_error_is_shown_once(model, tmp_path):
    spec, ckpt = model
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    lost = sorted(index["weight_map"])[-1]
    shard = broken / index["weight_map"].pop(lost)
    tensors = load_file(shard)
    del tensors[lost]
    save_file(tensors, shard)
    index_path.write_text(json.dumps(index))
    proc = _cli(
        "run", "--spec", str(spec), "--checkpoint", str(broken), "--tp", "2", "--prompt", "1"
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and lost in errors[0] and "Traceback" not in err


@pytest.mark.parametrize(
    "prompt,words", [("", "empty prompt"), (",".join(["1"] * 500), "max_seq_len")]
)
def test_run_with_an_unusable_prompt_isone_line(model, prompt, words):
    spec, ckpt = model
    proc = _cli(
        "run", "--spec", str(spec), "--checkpoint", str(ckpt), "--tp", "1", "--prompt", prompt
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert words in line and "Traceback" not in err
