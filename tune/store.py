"""The tuned-config store: ``tune/configs/<device>/<family>,<shape key>.json``.

A file maps bucket (decode batch size or prefill token count, as a string) to a
meta-parameter config, with the triton and torch versions and the date it was
tuned. Reading never fails: a missing, corrupt or foreign file yields the
documented defaults and a reason for the manifest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")

# Documented defaults (GPU starting points, the same for every family that tiles a
# GEMM): a small BLOCK_M because decode batches are small; N/K blocks are capped at
# the padded problem size by ``clamp_meta``.
DEFAULT_META: dict[str, int] = {
    "BLOCK_M": 16,
    "BLOCK_N": 64,
    "BLOCK_K": 64,
    "num_warps": 4,
    "num_stages": 3,
}


@dataclass(frozen=True)
class MetaChoice:
    meta: dict[str, int]
    source: str  # "default (...)" or "tuned: <file> bucket <b>"


def normalise_device_name(name: str) -> str:
    """'NVIDIA H200 NVL' -> 'NVIDIA_H200'. Spaces become underscores; board variants of
    one chip (NVL, SXM, PCIe, HBM3 sizes) fold to the chip."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", name.strip()).strip("_")
    name = re.sub(r"(_(NVL|SXM\d*|PCIE|HBM\d*e?|\d+GB))+$", "", name, flags=re.IGNORECASE)
    return name


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def clamp_meta(meta: dict[str, int], n: int, k: int) -> dict[str, int]:
    """No block larger than the (power-of-two padded) dimension; at least 16 for tl.dot."""
    out = dict(meta)
    out["BLOCK_N"] = max(16, min(out["BLOCK_N"], next_pow2(n)))
    out["BLOCK_K"] = max(16, min(out["BLOCK_K"], next_pow2(k)))
    return out


def config_path(device: str, family: str, shape_key: str, root: Path = CONFIG_ROOT) -> Path:
    return root / normalise_device_name(device) / f"{family},{shape_key}.json"


def nearest_bucket(buckets: list[int], want: int) -> int:
    """The closest bucket; ties go to the larger one (a config tuned for more rows is
    the safer choice)."""
    return min(buckets, key=lambda b: (abs(b - want), -b))


def choose(
    family: str,
    shape_key: str,
    n: int,
    k: int,
    device: str | None,
    bucket: int,
    root: Path = CONFIG_ROOT,
) -> MetaChoice:
    """Meta-parameters for one kernel: the tuned file's nearest bucket, else defaults."""
    default = clamp_meta(DEFAULT_META, n, k)
    if not device:
        return MetaChoice(default, "default (no device name given)")
    path = config_path(device, family, shape_key, root)
    if not path.is_file():
        return MetaChoice(default, f"default (no tuned file for {normalise_device_name(device)})")
    try:
        data = json.loads(path.read_text())
        table = {int(b): _valid_meta(cfg) for b, cfg in data["configs"].items()}
        if not table:
            raise ValueError("no configs")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return MetaChoice(default, f"default (unreadable tuned file {path.name}: {exc})")
    b = nearest_bucket(sorted(table), bucket)
    return MetaChoice(clamp_meta(table[b], n, k), f"tuned: {path.name} bucket {b}")


def _valid_meta(cfg: Any) -> dict[str, int]:
    if not isinstance(cfg, dict) or set(cfg) != set(META_KEYS):
        raise ValueError(f"config keys must be {', '.join(META_KEYS)}")
    for key, value in cfg.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise ValueError(f"{key} must be an integer in 1..1024")
        if key.startswith("BLOCK") and value & (value - 1):
            raise ValueError(f"{key} must be a power of two")
    return dict(cfg)
