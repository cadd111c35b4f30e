"""``deinfer launch``'s arguments without starting anything: what it hands torchrun,
and the one-line refusals. The job itself across emulated machines:
``tests/test_multi_host.py``."""

from __future__ import annotations

import pytest

from cli.launch import LaunchConfig, torchrun_arguments
from cli.main import main
from dsl.errors import UserError


def test_the_endpoints_machine_hosts_the_rendezvous():
    config = LaunchConfig(2, 1, "10.0.0.1:29400", local_addr="10.0.0.1", join_timeout_s=60)
    argv = torchrun_arguments(config, ["run", "--tp", "2"])
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=60,is_host=1"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--max-restarts") + 1] == "0"
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.1"
    assert argv[-5:] == ["-m", "cli.main", "run", "--tp", "2"]
    other = torchrun_arguments(LaunchConfig(2, 1, "10.0.0.1:29400", local_addr="10.0.0.2"), [])
    assert other[other.index("--rdzv-conf") + 1] == "join_timeout=300"
    plain = torchrun_arguments(LaunchConfig(2, 1, "a.example:29400"), [])
    assert "--local-addr" not in plain  # torchrun takes the host name


@pytest.mark.parametrize(
    "config,needle",
    [
        (LaunchConfig(0, 1, "h:1"), "--nnodes and --nproc-per-node must be at least 1"),
        (LaunchConfig(2, 1, "h"), "--rdzv-endpoint 'h': expected HOST:PORT"),
        (LaunchConfig(2, 1, "h:99999"), "expected HOST:PORT with a port 1 to 65535"),
        (LaunchConfig(2, 1, "h:1", join_timeout_s=0), "--join-timeout must be positive"),
    ],
)
def test_bad_arguments_are_one_line(config, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        config.check()


def test_only_engine_commands_are_launched(capsys):
    code = main(["launch", "--nnodes", "2", "--rdzv-endpoint", "h:1", "bench", "--tp", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "error: deinfer launch: expected one of run, serve, found 'bench'"
