"""What every family generator needs: the spec, its plans and the tuning source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsl import Plan, Spec
from dsl.plan import LayerPlan
from tune.store import CONFIG_ROOT, ConfigChoice, choose


@dataclass(frozen=True)
class GenContext:
    spec: Spec
    plan: Plan  # all modes at the spec's tp
    device: str | None  # normalised GPU name for tuned configs, or None
    config_root: Path = CONFIG_ROOT  # the tuned-config store

    @property
    def tp(self) -> int:
        return self.plan.tp

    def layer_plans(self, mode: str) -> tuple[LayerPlan, ...]:
        return self.plan.modes[mode].layer_plans

    def meta(self, family: str, shape_key: str, n: int, k: int) -> ConfigChoice:
        """Tuned or default meta-parameters per row bucket: the spec's decode batch
        sizes and its largest prefill (max_batch_size tokens and more)."""
        rt = self.spec.runtime
        buckets = (*rt.cuda_graph_batch_sizes, rt.max_batch_size, 256)
        return choose(family, shape_key, n, k, self.device, buckets, self.config_root)
