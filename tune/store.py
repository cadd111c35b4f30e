"""The tuned-config store: ``tune/configs/<device>/<family>,<shape key>.json``.

A file maps bucket (rows of a launch: decode batch size or prefill tokens) to a
meta-parameter config, with the triton and torch versions and the date it was tuned.
Reading never fails: a missing, corrupt or foreign-version file yields the documented
defaults, with a warning and a reason for the manifest.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsl.buckets import nearest_bucket

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")

# Documented defaults: GPU starting points for every family that tiles a GEMM, by row
# bucket. Decode launches have few rows (BLOCK_M 16); prefill has many (BLOCK_M 64).
# N and K blocks are capped at the padded problem size by ``clamp_meta``.
DEFAULT_CONFIGS: dict[int, dict[str, int]] = {
    1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    256: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
}


class TunedFileWarning(UserWarning):
    """A tuned-config file could not be used; defaults were taken."""


@dataclass(frozen=True)
class ConfigChoice:
    configs: dict[int, dict[str, int]]  # bucket -> meta-parameters, as baked into a kernel
    source: str  # "default (...)" or "tuned: <file>"


def normalise_device_name(name: str) -> str:
    """'NVIDIA H200 NVL' -> 'NVIDIA_H200'. Non-alphanumerics become underscores; board
    variants of one chip (NVL, SXM, PCIe, memory sizes) fold to the chip."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", name.strip()).strip("_")
    return re.sub(r"(_(NVL|SXM\d*|PCIE|HBM\d*E?|\d+GB))+$", "", name, flags=re.IGNORECASE)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def clamp_meta(meta: dict[str, int], n: int, k: int) -> dict[str, int]:
    """No block larger than the (power-of-two padded) dimension; at least 16 for tl.dot."""
    out = {key: meta[key] for key in META_KEYS}
    out["BLOCK_N"] = max(16, min(out["BLOCK_N"], next_pow2(n)))
    out["BLOCK_K"] = max(16, min(out["BLOCK_K"], next_pow2(k)))
    return out


def config_path(device: str, family: str, shape_key: str, root: Path = CONFIG_ROOT) -> Path:
    return root / normalise_device_name(device) / f"{family},{shape_key}.json"


def versions() -> dict[str, str]:
    import torch
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__.split("+")[0]}


def defaults(n: int, k: int) -> dict[int, dict[str, int]]:
    return {b: clamp_meta(cfg, n, k) for b, cfg in DEFAULT_CONFIGS.items()}


def choose(
    family: str,
    shape_key: str,
    n: int,
    k: int,
    device: str | None,
    buckets: tuple[int, ...],
    root: Path = CONFIG_ROOT,
) -> ConfigChoice:
    """The configs baked into one kernel: for each of ``buckets``, the tuned file's
    nearest bucket; the defaults when there is no usable file."""
    if not device:
        return ConfigChoice(defaults(n, k), "default (no device name given)")
    path = config_path(device, family, shape_key, root)
    if not path.is_file():
        return ConfigChoice(
            defaults(n, k), f"default (no tuned file for {normalise_device_name(device)})"
        )
    try:
        table = read_table(path)
    except ValueError as exc:
        warnings.warn(f"{path}: {exc}; using the defaults", TunedFileWarning, stacklevel=2)
        # The reason is written into generated code: only plain characters go there.
        reason = re.sub(r"[^A-Za-z0-9_ .,:;()/+=-]", "", str(exc))[:120]
        return ConfigChoice(defaults(n, k), f"default (unusable tuned file {path.name}: {reason})")
    picked = {b: clamp_meta(table[nearest_bucket(table, b)], n, k) for b in sorted(set(buckets))}
    return ConfigChoice(picked, f"tuned: {path.parent.name}/{path.name}")


def read_table(path: Path) -> dict[int, dict[str, int]]:
    """bucket -> config of a tuned file; ValueError if corrupt or from other versions."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not readable JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise ValueError("no 'configs' mapping")
    mine = versions()
    theirs = {k: data.get(k) for k in mine}
    if theirs != mine:
        raise ValueError(f"tuned with {theirs}, this is {mine}")
    table = {}
    for bucket, cfg in data["configs"].items():
        if not str(bucket).isdigit() or int(bucket) < 1:
            raise ValueError(f"bucket {bucket!r} is not a positive integer")
        table[int(bucket)] = _valid_meta(cfg)
    if not table:
        raise ValueError("no configs")
    return table


def write_table(path: Path, table: dict[int, dict[str, int]], extra: dict[str, Any]) -> None:
    """Write a tuned file (the tuner's output), atomically."""
    for cfg in table.values():
        _valid_meta(cfg)
    data = {**versions(), **extra, "configs": {str(b): table[b] for b in sorted(table)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _valid_meta(cfg: Any) -> dict[str, int]:
    if not isinstance(cfg, dict) or set(cfg) != set(META_KEYS):
        raise ValueError(f"config keys must be {', '.join(META_KEYS)}")
    for key, value in cfg.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise ValueError(f"{key} must be an integer in 1..1024")
        if (key.startswith("BLOCK") or key == "num_warps") and value & (value - 1):
            raise ValueError(f"{key} must be a power of two")
    return {key: cfg[key] for key in META_KEYS}
