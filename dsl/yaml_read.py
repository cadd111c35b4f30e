"""Reading an untrusted YAML spec into plain data, before any schema check.

The file is size-capped and must be UTF-8; the safe loader takes no tags and no
duplicate keys, and bounds what an alias "bomb" or deep nesting can make it build.
Every failure raises ``SpecError``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from dsl.errors import SpecError

MAX_SPEC_BYTES = 1 << 20  # real specs are a few KiB; a larger file is a mistake or an attack
# A spec is a few hundred nodes; these bound what an untrusted file can make the parser
# build (an alias "bomb" expands 9 aliases of 9 aliases... to 10**9 nodes) or recurse into.
MAX_YAML_NODES = 20_000  # counted with every alias expanded
MAX_YAML_DEPTH = 32
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60
_QUOTE.maxlist = _QUOTE.maxdict = 4
_QUOTE.maxlevel = 2


def _quote(value: Any) -> str:
    """A bad value as an error message shows it: at most ~80 characters, whatever it is."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"  # str() of a huge int raises
    return _QUOTE.repr(value)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that also rejects duplicate keys (a silent override hides typos) and
    trees deeper than MAX_YAML_DEPTH or larger than MAX_YAML_NODES once expanded."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                reason = f"YAML nested deeper than {MAX_YAML_DEPTH} levels (line {line})"
                raise SpecError("", reason)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):  # type: ignore[no-untyped-def]
        node = super().get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_NODES:
            raise SpecError("", f"YAML has more than {MAX_YAML_NODES} nodes once aliases expand")
        return node


def _expanded_size(node: yaml.Node, seen: dict[int, int]) -> int:
    """Nodes in the tree with every alias copied out (shared nodes counted per use)."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = 1  # a cycle (only via a recursive alias) counts once
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, seen) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.value)
    seen[id(node)] = min(size, MAX_YAML_NODES + 1)
    return seen[id(node)]


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            line = key_node.start_mark.line + 1
            raise SpecError("", f"a {type(key).__name__} used as a mapping key at line {line}")
        if key in seen:
            line = key_node.start_mark.line + 1
            raise SpecError("", f"duplicate key {_quote(key)} at line {line}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_spec_text(path: str | Path) -> str:
    """A spec file's text: it must exist, be at most 1 MiB and be UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("", f"spec file not found: {path}")
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise SpecError("", f"spec file is {size} bytes, more than the {MAX_SPEC_BYTES} allowed")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"spec file is not UTF-8 (byte {exc.start})") from None


def read_yaml(text: str) -> Any:
    """The plain data (mappings, lists, scalars) of YAML ``text``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except SpecError:
        raise
    except yaml.constructor.ConstructorError as exc:
        raise SpecError("", f"YAML construct not allowed: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError("", f"invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of 100,000 digits
        raise SpecError("", f"unreadable YAML value: {str(exc)[:80]}") from None
