"""Type and range checks of plain YAML data; each failure names the YAML path."""

from __future__ import annotations

from typing import Any

from dsl.errors import SpecError
from dsl.yaml_read import _quote


class Checks:
    @staticmethod
    def mapping(raw: Any, path: str, required: set[str], optional: set[str]) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise SpecError(path or "(top level)", f"expected a mapping, found {_kind(raw)}")
        for key in raw:
            if not isinstance(key, str) or key not in required | optional:
                allowed = ", ".join(sorted(required | optional))
                raise SpecError(_join(path, str(key)), f"unknown key (allowed: {allowed})")
        for key in sorted(required):
            if key not in raw:
                raise SpecError(_join(path, key), "missing required field")
        return raw

    @staticmethod
    def integer(raw: Any, path: str, lo: int = 1, hi: int = 1 << 31) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise SpecError(path, f"expected an integer, found {_kind(raw)}")
        if not lo <= raw <= hi:
            raise SpecError(path, f"must be between {lo} and {hi}, found {_quote(raw)}")
        return raw

    @staticmethod
    def number(raw: Any, path: str, lo: float, hi: float, open_lo: bool = False) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise SpecError(path, f"expected a number, found {_kind(raw)}")
        if not (lo < raw if open_lo else lo <= raw) or not raw <= hi:
            bracket = "(" if open_lo else "["
            raise SpecError(path, f"must be in {bracket}{lo}, {hi}], found {_quote(raw)}")
        return float(raw)

    @staticmethod
    def boolean(raw: Any, path: str) -> bool:
        if not isinstance(raw, bool):
            raise SpecError(path, f"expected true or false, found {_kind(raw)}")
        return raw

    @staticmethod
    def choice(raw: Any, path: str, allowed: tuple[str, ...]) -> str:
        if not isinstance(raw, str) or raw not in allowed:
            raise SpecError(path, f"must be one of {', '.join(allowed)}, found {_quote(raw)}")
        return raw

    # --- sections -------------------------------------------------------------------


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"{type(value).__name__} {_quote(value)}"
