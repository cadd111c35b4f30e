"""Spec language, rank rules, sharding plan and accounting. Never imports torch."""

from dsl.dataflow import build_plan
from dsl.errors import SpecError
from dsl.load import load_spec, parse_spec
from dsl.plan import MODES, Plan
from dsl.spec import Spec
from dsl.variants import with_ratio, with_runtime, with_tp

__all__ = [
    "MODES",
    "Plan",
    "Spec",
    "SpecError",
    "build_plan",
    "load_spec",
    "parse_spec",
    "with_ratio",
    "with_runtime",
    "with_tp",
]
