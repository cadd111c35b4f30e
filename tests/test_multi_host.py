"""Tensor parallelism across machines: two ``deinfer launch`` agents (torchrun, c10d
rendezvous), each in a network namespace of its own behind an emulated link, stand for
two machines. The ranks across them give tp 1's greedy tokens (``run`` and ``serve``);
a machine's agent killed mid-generation, or its link cut, is named by the survivor,
which exits non-zero within 20 s and leaves no process behind; a rendezvous that never
completes is one line after its stated timeout. The command lines are the README's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.launch import AGENT_LEAVE_S as LEAVE_S
from runtime.dist.emulated_hosts import EmulatedHosts
from runtime.dist.emulated_link import LinkSpec
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from tests.conftest import REPO
from tests.serving import serving_checkpoint
from tests.test_emulated_link import needs_netns

pytestmark = needs_netns
PROMPTS = ["t1 t2 t3 t4 t5", "t7 t8"]
MAX_TOKENS = 7
LINK = LinkSpec.parse("1gbit")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(spec, checkpoint, tp 1's greedy text for PROMPTS)."""
    spec, ckpt = serving_checkpoint(tmp_path_factory.mktemp("multi_host"))
    with LLM(spec, ckpt, tp=1) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return spec, ckpt, [o.text for o in outs]


def launch_command(
    hosts: EmulatedHosts, host: int, port: int, nproc: int, command: list[str], **options: str
) -> list[str]:
    """``deinfer launch`` as the README gives it, for ``host`` of ``hosts``."""
    extra = [x for key, value in options.items() for x in (f"--{key.replace('_', '-')}", value)]
    return hosts.command(
        host,
        [
            sys.executable, "-m", "cli.main", "launch",
            "--nnodes", str(hosts.hosts),
            "--nproc-per-node", str(nproc),
            "--rdzv-endpoint", f"{hosts.address(0)}:{port}",
            "--local-addr", hosts.address(host),
            *extra,
            *command,
        ],
    )  # fmt: skip


class Agents:
    """One ``deinfer launch`` per host; their output lines, timed, read as they come."""

    def __init__(self, commands: list[list[str]]) -> None:
        self.start = time.monotonic()
        self.lines: list[list[tuple[float, str]]] = [[] for _ in commands]
        self.procs = [
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
            )
            for cmd in commands
        ]
        self.readers = [
            threading.Thread(target=self._read, args=(i,), daemon=True)
            for i in range(len(commands))
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, i: int) -> None:
        for line in self.procs[i].stdout:
            self.lines[i].append((time.monotonic() - self.start, line.rstrip()))

    def text(self, i: int) -> str:
        return "\n".join(line for _, line in self.lines[i])

    def wait_for(self, i: int, needle: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, line in list(self.lines[i]):
                if needle in line:
                    return t
            if self.procs[i].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"host {i} never said {needle!r}:\n{self.text(i)[-3000:]}")

    def wait(self, timeout_s: float) -> list[int]:
        for p in self.procs:
            p.wait(timeout=timeout_s)
        for reader in self.readers:
            reader.join(timeout=10)
        return [p.returncode for p in self.procs]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def processes_of(run_id: str) -> list[str]:
    """Every live process whose command line names this job."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if run_id in cmdline:
                found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def run_args(spec: Path, ckpt: Path, tp: int, prompts: list[str], max_tokens: int) -> list[str]:
    args = ["run", "--spec", str(spec), "--checkpoint", str(ckpt), "--tp", str(tp)]
    for p in prompts:
        args += ["--prompt", p]
    return [*args, "--max-tokens", str(max_tokens)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_ranks_across_two_hosts_give_the_tokens_of_tp1(model, nproc):
    spec, ckpt, want = model
    tp = 2 * nproc
    command = run_args(spec, ckpt, tp, PROMPTS, MAX_TOKENS)
    with EmulatedHosts(2, LINK) as hosts:
        port = hosts.free_port(0)
        agents = Agents(
            [
                launch_command(hosts, h, port, nproc, command, rdzv_id=f"run-{os.getpid()}-{nproc}")
                for h in range(2)
            ]
        )
        try:
            codes = agents.wait(timeout_s=240)
        finally:
            agents.kill_all()
    assert codes == [0, 0], agents.text(0)[-3000:] + agents.text(1)[-3000:]
    for prompt, text in zip(PROMPTS, want, strict=True):
        assert f"{prompt!r} -> {text}" in agents.text(0)
        assert "->" not in agents.text(1)  # rank 0's host reports; the other follows


def test_serve_across_two_hosts_answers_on_rank0s_host(model):
    spec, ckpt, want = model
    with EmulatedHosts(2, LINK) as hosts:
        port, http = hosts.free_port(0), hosts.free_port(0)
        serve = ["serve", "--spec", str(spec), "--checkpoint", str(ckpt), "--tp", "2"]
        serve += ["--host", "127.0.0.1", "--port", str(http)]
        agents = Agents(
            [
                launch_command(hosts, h, port, 1, serve, rdzv_id=f"serve-{os.getpid()}")
                for h in range(2)
            ]
        )
        try:
            agents.wait_for(0, "Application startup complete", timeout_s=180)
            client = hosts.command(0, [sys.executable, "-c", COMPLETION_CLIENT, str(http)])
            answer = subprocess.run(client, capture_output=True, text=True, timeout=60, cwd=REPO)
            assert answer.returncode == 0, answer.stderr[-2000:]
            agents.procs[0].send_signal(signal.SIGINT)  # Ctrl-C on rank 0's machine
            codes = agents.wait(timeout_s=60)
        finally:
            agents.kill_all()
    assert json.loads(answer.stdout)["choices"][0]["text"] == want[0]
    assert codes[1] == 0, agents.text(1)[-3000:]  # the follower left with the leader
    assert codes[0] != 0 and "stopped" in agents.text(0), agents.text(0)[-3000:]


COMPLETION_CLIENT = f"""
import json, sys, httpx
url = f"http://127.0.0.1:{{sys.argv[1]}}/v1/completions"
body = {{"model": "tiny-hf", "prompt": {PROMPTS[0]!r}, "max_tokens": {MAX_TOKENS},
        "temperature": 0}}
print(json.dumps(httpx.post(url, json=body, timeout=60).json()))
"""


LONG_PROMPTS = [f"t{i} t{i + 1} t{i + 2}" for i in range(1, 9)]


def generating(hosts: EmulatedHosts, spec: Path, ckpt: Path, run_id: str) -> Agents:
    """tp 2 over the two hosts, 8 prompts × 400 tokens (far longer than a test waits),
    returned a second into the generation."""
    port = hosts.free_port(0)
    command = run_args(spec, ckpt, 2, LONG_PROMPTS, 400)
    agents = Agents([launch_command(hosts, h, port, 1, command, rdzv_id=run_id) for h in range(2)])
    try:
        agents.wait_for(0, "loaded in", timeout_s=180)
    except BaseException:
        agents.kill_all()
        raise
    time.sleep(1.0)
    return agents


@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_hosts_agent_is_named_by_the_survivor_within_20s(model, lost):
    """Mid-generation, one host's agent gets SIGKILL (its worker dies with it); the
    other host's side names the lost rank and host, exits non-zero within 20 s, and no
    process of the job is left on either host."""
    spec, ckpt, _ = model
    run_id = f"kill-{os.getpid()}-{lost}"
    survivor = 1 - lost
    with EmulatedHosts(2, LINK) as hosts:
        agents = generating(hosts, spec, ckpt, run_id)
        try:
            killed_at = time.monotonic() - agents.start
            agents.procs[lost].send_signal(signal.SIGKILL)
            agents.procs[survivor].wait(timeout=20)
            exited_at = time.monotonic() - agents.start
            agents.wait(timeout_s=10)
        finally:
            agents.kill_all()
        left = processes_of(run_id)
    said = agents.text(survivor)
    assert "->" not in agents.text(0)  # killed before any prompt finished
    assert agents.procs[survivor].returncode not in (0, None)
    assert exited_at - killed_at <= 20
    assert f"lost rank {lost} on host {hosts.address(lost)}" in said, said[-3000:]
    assert left == []


def test_a_cut_link_is_named_by_both_sides(model):
    """Host 1's link goes down mid-generation (no connection is told): rank 0 names rank
    1 after the heartbeat timeout and its host's job ends; the cut host names rank 0 and
    its agent, stuck on the unreachable store, leaves on its own; no process is left."""
    spec, ckpt, _ = model
    run_id = f"cut-{os.getpid()}"
    with EmulatedHosts(2, LINK) as hosts:
        agents = generating(hosts, spec, ckpt, run_id)
        try:
            cut_at = time.monotonic() - agents.start
            hosts.cut(1)
            agents.procs[0].wait(timeout=40)
            exited_at = time.monotonic() - agents.start
            named_at = agents.wait_for(1, "lost rank 0", timeout_s=30)
            agents.procs[1].wait(timeout=LEAVE_S + 20)
        finally:
            agents.kill_all()
        left = processes_of(run_id)
    assert agents.procs[0].returncode != 0 and agents.procs[1].returncode != 0
    assert exited_at - cut_at <= 15 + 10  # the heartbeat timeout, then the agent's exit
    assert named_at - cut_at <= 15 + 10
    assert f"lost rank 1 on host {hosts.address(1)}: no heartbeat" in agents.text(0)
    assert "could not leave the rendezvous" in agents.text(1)
    assert left == []


def test_a_rendezvous_that_never_completes_is_one_line(model):
    spec, ckpt, _ = model
    with EmulatedHosts(2, LINK) as hosts:
        port = hosts.free_port(0)
        command = launch_command(
            hosts, 0, port, 1, run_args(spec, ckpt, 2, PROMPTS, 2),
            rdzv_id=f"alone-{os.getpid()}", join_timeout="4",
        )  # fmt: skip
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
        took = time.monotonic() - start
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: the rendezvous at {hosts.address(0)}:{port} (job 'alone-{os.getpid()}') did "
        "not complete within 4 s: 2 machines must start with the same --rdzv-endpoint, "
        "--rdzv-id and --nnodes and reach the endpoint"
    ]
    assert took < 4 + 30
