"""Test configuration. The Triton interpreter must be chosen before any kernel
module is imported, so it is set here, first."""

import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# The engines' tuning cache in a folder of this run's own: no test reads what another
# run (or the user) stored, and none writes under the home directory.
os.environ["DEINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="deinfer-test-cache-")

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"

# CI gets a bounded number of examples; `HYPOTHESIS_PROFILE=thorough` runs more.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Examples of the multi-process tests (each starts work on a process group).
TP_EXAMPLES = 5 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 40


# The native kernels built once more with their wider instructions turned off, on this
# x86 CPU: (extra compiler flags, floats per vector) — the AVX2 and portable widths.
narrower_builds = pytest.mark.parametrize(
    ("flags", "width"),
    [(("-mno-avx512f",), 8), (("-mno-avx",), 4)],
    ids=["avx2-width", "portable-width"],
)


def assert_x86_vectors() -> None:
    """The flags of ``narrower_builds`` are x86's: the CPU must have AVX2 or AVX-512."""
    cpu = Path("/proc/cpuinfo").read_text()
    assert " avx2 " in cpu or " avx512f " in cpu, "these flags are x86's"


def deinfer_cli(*args: str, cwd: Path = REPO, env: dict | None = None):
    """``deinfer ARGS`` in a child process (the installed entry point's module)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env=env,
    )


@pytest.fixture
def repo() -> Path:
    return REPO
