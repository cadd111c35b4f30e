"""Rendering: a strict jinja2 environment, a guard on what may reach emitted code,
and the do-not-edit header."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from codegen.version import __version__

TEMPLATES = Path(__file__).resolve().parent / "templates"
# Strings that reach emitted code are built from a fixed vocabulary and numbers; this
# pattern has no quote, backslash, brace, '#' or newline, so no string can leave the
# literal, comment or docstring it is placed in.
SAFE_TEXT = re.compile(r"[A-Za-z0-9_ .,:;|+=()\[\]/<>*-]*")  # fullmatch: "$" lets "\n" in


class UnsafeValueError(ValueError):
    """A value that is not a number, a boolean or vocabulary text was about to be emitted."""


@dataclass(frozen=True)
class KernelFile:
    """One generated file: which template renders it and with what values."""

    family: str
    file_name: str
    template: str
    values: dict[str, Any]
    # What the manifest records: one entry, or one per shape the file is specialised for.
    manifest: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)

    def manifest_entries(self) -> list[dict[str, Any]]:
        return self.manifest if isinstance(self.manifest, list) else [self.manifest]


def check_safe(value: Any, path: str = "values") -> None:
    """Reject anything but numbers, booleans, vocabulary text and containers of them."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise UnsafeValueError(f"{path}: non-finite number")
        return
    if isinstance(value, str):
        if not SAFE_TEXT.fullmatch(value):
            raise UnsafeValueError(f"{path}: text {value[:40]!r} is not from the vocabulary")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_safe(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_safe(key, f"{path} key")
            check_safe(item, f"{path}.{key}")
        return
    raise UnsafeValueError(f"{path}: {type(value).__name__} cannot be emitted")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def template_hash(name: str) -> str:
    """Hash of a template and the partials (``_*.j2``) it may include."""
    partials = "".join(p.read_text() for p in sorted(TEMPLATES.glob("_*.j2")))
    return sha256_text((TEMPLATES / name).read_text() + partials)


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(kernel: KernelFile, spec_name: str, spec_hash: str) -> str:
    check_safe(kernel.values)
    check_safe(spec_name, "spec name")
    header = {
        "tool_version": __version__,
        "spec_name": spec_name,
        "spec_hash": spec_hash[:16],
        "template": kernel.template,
        "template_hash": template_hash(kernel.template)[:16],
    }
    return _environment().get_template(kernel.template).render(**header, **kernel.values)
