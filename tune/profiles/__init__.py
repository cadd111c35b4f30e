"""Device profiles for the cost model (``tune.cost_model``): data files beside this
module, one per device, each with where its numbers come from.

``load_profile("a800-pcie")`` reads ``a800-pcie.yaml`` here; a path to a YAML file of
the same fields works too (``deinfer predict --calibrate`` writes one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from dsl.errors import UserError

PROFILE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class DeviceProfile:
    """What one rank can do. Rates are per rank: on a CPU the ranks share the memory
    bus, so a calibrated profile measures them with every rank running at once."""

    name: str
    description: str
    memory_bytes_per_s: float
    matmul_flops_per_s: float
    link_bytes_per_s: float  # each direction, per rank
    link_latency_s: float  # per step of a ring collective
    op_overhead_s: float  # per operator launched (dispatch; 0 where kernels are timed)
    source: str

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(
            f"device profile {str(name_or_path)!r} not found "
            f"(built in: {', '.join(builtin_profiles())}; or a path to a .yaml file)"
        )
    raw = yaml.safe_load(path.read_text())
    names = {f.name for f in fields(DeviceProfile)}
    if not isinstance(raw, dict) or set(raw) != names:
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{path}: a device profile has exactly {sorted(names)}, found {found}")
    for key in names - {"name", "description", "source"}:
        if not isinstance(raw[key], int | float) or raw[key] < 0:
            raise UserError(f"{path}: {key} must be a number >= 0, found {raw[key]!r}")
    return DeviceProfile(**raw)
