"""Links for ``deinfer bench`` chosen by the cost model, and its prediction of each row.

A link given as ``ratio:X`` is the emulated rate at which Base's communication time
per block is X times its compute time, on this machine, for the bench's batch and
context: the paper's Table 5 has X ≈ 5.2 without NVLink (12.182 / 2.352 ms) and
≈ 0.37 with it (0.891 / 2.391 ms). This machine is calibrated first (``calibrate``); the
model gives the effective link rate for X; the tc rate that delivers it is found by
measuring all-gathers across a trial link and correcting (tc's nominal rate is not what
gloo over TCP achieves through it).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

from dsl import build_plan, load_spec
from dsl.errors import UserError
from dsl.plan import DOWN_SHARDED, UP_REPLICATED
from runtime.dist.emulated_link import LinkSpec
from tune.calibrate import calibrate, probe_compute, slowest_rank
from tune.cost_model import (
    Workload,
    gemm_seconds,
    link_rate_for_ratio,
    local_gemms,
    predict_block,
)
from tune.profiles import DeviceProfile

RATIO = "ratio:"
# 8 Gbit/s: loopback gloo here carries ~0.3 GB/s, far below it.
MAX_TC_RATE = 8e9


def bench_workload(cfg: Any, batch: int | None) -> Workload:
    """A throughput run's decode steps: ``batch`` rows, attending on average to the
    prompt plus half the output."""
    rows = batch or min(cfg.num_requests, cfg.max_batch)
    return Workload(rows, cfg.prompt_len + cfg.output_len // 2)


class CostModelPlanner:
    def __init__(self, threads: int = 1, profile: DeviceProfile | None = None) -> None:
        self.threads = threads
        self.profile = profile
        self.targets: dict[str, dict[str, float]] = {}
        self.message_bytes = 0
        self.samples: dict[str, list[dict[str, float]]] = {}
        self.shapes: list[tuple[int, int]] = []
        self.compute_scale = 1.0
        self.fitted: dict[str, Any] = {}

    def resolve(self, cfg: Any, fit: tuple[str, Any, float] | None = None) -> dict[str, str]:
        """tc rates for ``cfg.links``; every link is also measured with all-gathers of
        the size of Base's collectives at the bench's batch (the rate used to predict).

        ``fit`` = (mode, live engine, its measured compute ms per block): the one number
        fitted on this machine, as the tokens per forward are for Table 5. The roofline
        of the rates measured inside that engine's ranks, times ``compute_scale``, is
        the measured figure; every other figure is predicted with that scale."""
        from runtime.dist.launcher import WorkerGroup

        tp = max(cfg.tps)
        calibrating = self.profile is None
        if calibrating:
            self.profile = calibrate(tp, cfg.threads or self.threads)
        spec = load_spec(cfg.spec)
        plan = build_plan(spec, tp, modes=tuple(dict.fromkeys((*cfg.modes, "base"))))
        # The matrices this bench's ranks multiply: what their streaming rate is measured on.
        self.shapes = [
            (n_in, n_out)
            for mode in cfg.modes
            for lp in plan.modes[mode].layer_plans
            for _, n_in, n_out in local_gemms(lp)
        ]
        base = plan.modes["base"]
        work = bench_workload(cfg, cfg.batches[0] if cfg.batches else None)
        per_collective = (
            base.ring_elements_per_rank_per_token_per_block()
            * work.tokens
            * base.dtype_bytes
            / base.collectives_per_block()
        )
        self.message_bytes = int(per_collective / (tp - 1))
        if fit is not None:
            mode, engine, measured_ms = fit
            self.profile = replace(
                self.profile, **slowest_rank(engine.workers.run(probe_compute, self.shapes, 3))
            )
            roofline_ms = self._compute_ms(spec, tp, mode, cfg, None, {})
            self.compute_scale = measured_ms / roofline_ms
            self.fitted = {"mode": mode, "measured_ms": measured_ms, "roofline_ms": roofline_ms}
        with WorkerGroup(tp, timeout_s=300, link=LinkSpec(1e9)) as group:
            if calibrating and fit is None:  # the compute rates on this model's matrices
                self.profile = replace(
                    self.profile, **slowest_rank(group.run(probe_compute, self.shapes))
                )
            return {entry: self._set_rate(group, entry, base, work) for entry in cfg.links}

    def _set_rate(self, group: Any, entry: str, base: Any, work: Any) -> str:
        """Shape ``group``'s link as ``entry`` asks, measure it, return the tc rate."""
        target: dict[str, float] = {}
        if entry.startswith(RATIO):
            ratio = float(entry[len(RATIO) :])
            try:
                wanted = link_rate_for_ratio(base, self._scaled(self.profile), work, ratio)
            except ValueError as exc:  # measured here: a bench that asks it must stop
                raise UserError(f"--link {entry} at tp {base.tp}: {exc}") from None
            nominal = self._tc_rate_for(group, wanted)
            target = {"comm_over_compute": ratio, "wanted_bytes_per_s": wanted}
        else:
            nominal = LinkSpec.parse(entry).rate_bits_per_s
        group.set_link(LinkSpec(nominal), probe=False)
        measured = group.probe_link(self.message_bytes)["bytes_per_s"]
        self.targets[entry] = {
            **target,
            "tc_rate_bits_per_s": nominal,
            "measured_bytes_per_s": measured,
            "message_bytes": self.message_bytes,
        }
        return f"{nominal:.0f}bit"

    def _tc_rate_for(self, group: Any, wanted: float, rounds: int = 4) -> float:
        """The tc rate at which all-gathers of Base's message size run at ``wanted``
        (at most ``MAX_TC_RATE``: past what gloo over TCP can carry here, raising tc's
        rate changes nothing; the report then shows the ratio actually reached)."""
        nominal = wanted * 8 / 0.6  # gloo over TCP got 55–90 % of tc's rate here
        for _ in range(rounds):
            nominal = min(nominal, MAX_TC_RATE)
            group.set_link(LinkSpec(nominal), probe=False)
            achieved = group.probe_link(self.message_bytes)["bytes_per_s"]
            nominal *= wanted / achieved
        return min(nominal, MAX_TC_RATE)

    def probe(self, engine: Any, v: Any) -> None:
        """Re-measure the compute rates inside ``engine``'s ranks (between repetitions:
        this machine's speed drifts by up to 2x over minutes); ``predict`` uses the
        median of what was measured around ``v``'s runs."""
        ranks = engine.workers.run(probe_compute, self.shapes, 3)
        self.samples.setdefault(v.label, []).append(slowest_rank(ranks))

    def _rates(self, label: str) -> dict[str, float]:
        samples = self.samples.get(label, [])
        if not samples:
            return {}
        return {k: statistics.median(s[k] for s in samples) for k in samples[0]}

    def describe(self) -> dict[str, Any]:
        return {
            "profile": asdict(self.profile) if self.profile else None,
            "links": self.targets,
            "rates_measured_per_row": {label: self._rates(label) for label in self.samples},
            "compute_scale": self.compute_scale,
            "fitted_on": self.fitted,
        }

    def _scaled(self, dev: DeviceProfile) -> DeviceProfile:
        """``dev`` with every compute term ``compute_scale`` times slower."""
        k = self.compute_scale
        return replace(
            dev,
            memory_bytes_per_s=dev.memory_bytes_per_s / k,
            matmul_flops_per_s=dev.matmul_flops_per_s / k,
            op_overhead_s=dev.op_overhead_s * k,
        )

    def _compute_ms(
        self,
        spec: Any,
        tp: int,
        mode: str,
        cfg: Any,
        batch,
        rates: dict,
        layout=UP_REPLICATED,
        down_layout=DOWN_SHARDED,
    ) -> float:
        """The roofline compute of one block (with its share of the LM head), unscaled."""
        dev = replace(self.profile, **rates)
        plan = build_plan(spec, tp, modes=(mode,), up_layout=layout, down_layout=down_layout)
        mp = plan.modes[mode]
        work = bench_workload(cfg, batch)
        vocab_local = mp.lm_head_gather_elements // tp
        head = gemm_seconds(work.tokens, spec.model.hidden_size, vocab_local, mp.dtype_bytes, dev)
        return (predict_block(mp, dev, work).compute_s + head / mp.num_layers) * 1e3

    def predict(
        self, spec: Any, v: Any, cfg: Any, down_layout: str = DOWN_SHARDED
    ) -> dict[str, float]:
        """Per block, ms: compute (with the block's share of the LM head; roofline of the
        rates measured around ``v``'s runs, times the fitted scale), comm at the rate
        measured across ``v``'s link, total; ``down_layout`` as the engine resolved it."""
        # behind a link ``auto`` holds the up factors replicated (RunnerConfig.up_layout)
        layout = UP_REPLICATED if v.up_layout == "auto" else v.up_layout
        compute = self.compute_scale * self._compute_ms(
            spec, v.tp, v.mode, cfg, v.batch, self._rates(v.label), layout, down_layout
        )
        dev = replace(self.profile, link_bytes_per_s=self.targets[v.link]["measured_bytes_per_s"])
        plan = build_plan(spec, v.tp, modes=(v.mode,), up_layout=layout, down_layout=down_layout)
        mp = plan.modes[v.mode]
        comm = predict_block(mp, dev, bench_workload(cfg, v.batch)).comm_s * 1e3
        return {"compute_ms": compute, "comm_ms": comm, "total_ms": compute + comm}
