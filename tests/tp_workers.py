"""Functions that run inside tensor-parallel worker processes (importable by spawn)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen import generated_folder
from dsl import build_plan, parse_spec
from dsl.layout import with_merged
from dsl.plan import DOWN_REPLICATED, DOWN_SHARDED, UP_REPLICATED
from runtime.dist.comm import Comm
from runtime.kernels.loader import load_generated
from runtime.model.execution import execution_for
from runtime.model.layer_modes import LAYER_CLASSES
from runtime.model.layers import LayerSetup
from runtime.model.rope import inv_freq
from runtime.model.shard import DictSource, shard_layer


def causal_attention(captured: list):
    """Prefill attention of one sequence; records each call's latent."""

    def attention(index, q, k, v, latent):
        captured.append((index, None if latent is None else latent.clone()))
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            is_causal=True,
        )
        return out.transpose(0, 1).to(q.dtype)

    return attention


def mixed_merges(spec):
    """A mixed layout for tests: in even layer shapes q, o and up (fc1) merged — column
    groups with merged and latent members, a merged row matrix beside a latent one — in
    odd shapes k, v and down (fc2): no latent cache, a merged MLP output."""
    picks = ({"q", "o", "up", "fc1"}, {"k", "v", "down", "fc2"})
    merges = {}
    for i, shape in enumerate(spec.layer_shapes()):
        ranks = shape.as_dict()
        names = frozenset(n for n in picks[i % 2] if ranks.get(n) is not None)
        if names:
            merges[shape] = names
    return merges


def execution_plan(spec, world, run):
    """(the spec the run executes, its mode plan): ``"mixed"`` in ``run`` merges
    ``mixed_merges`` (the optimized layout's machinery on a fixed choice)."""
    mode, _, layout = run_parts(run)
    executed = with_merged(spec, mixed_merges(spec)) if "mixed" in run[3:] else spec
    plan = build_plan(executed, tp=world, up_layout=layout, down_layout=down_layout_of(run))
    return executed, plan.modes[mode]


def run_parts(run: tuple[str, ...]) -> tuple[str, str, str]:
    """(mode, backend[, up layout]) -> (mode, backend, up layout), replicated by default."""
    mode, backend, layout = (*run, UP_REPLICATED)[:3]
    return mode, backend, layout


def down_layout_of(run: tuple[str, ...]) -> str:
    """``"whole_downs"`` in ``run``: every rank holds the column groups' down factors."""
    return DOWN_REPLICATED if "whole_downs" in run[3:] else DOWN_SHARDED


def run_layers(rank, world, spec_text, folder, full_layers, x, positions, runs):
    """Run every layer of the spec on this rank for each (mode, backend[, up layout]) in
    ``runs``; returns {run: (hidden, comm elements by kind, captured latents)}."""
    spec = parse_spec(spec_text)
    registry = load_generated(folder).KERNELS
    freqs = (
        inv_freq(spec.model.positions, spec.model.head_dim)
        if spec.model.positions.kind == "rope"
        else None
    )
    results = {}
    for run in runs:
        mode, backend, layout = run_parts(run)
        plan = build_plan(spec, tp=world, up_layout=layout, down_layout=down_layout_of(run))
        comm = Comm(count=True)
        captured: list = []
        execution = execution_for(spec.model, registry, backend)
        n_valid = torch.tensor([x.shape[0]], dtype=torch.int32)
        batch = execution.batch(positions, n_valid, causal_attention(captured), freqs)
        h = x.clone()
        for index, layer_ranks in enumerate(spec.decomposition.layers):
            lp = plan.modes[mode].layer_plan(layer_ranks)
            full = full_layers[index][mode]
            weights = shard_layer(lp, DictSource(full), rank)
            weights.update({k: v for k, v in full.items() if "norm" in k})
            setup = LayerSetup(
                model=spec.model,
                plan=lp,
                rank=rank,
                comm=comm,
                execution=execution,
                inv_freq=freqs,
            )
            h = LAYER_CLASSES[mode](setup, index, weights).forward(h, batch)
        elements = {kind: s.elements for kind, s in comm.stats.by_kind.items()}
        results[run] = (h, elements, captured)
    return results


def run_overlapped_up(rank, world, folder, group, shape_id, m, seed):
    """Overlapped latent up-projection vs gather-then-GEMM on this rank; returns the
    max difference and the order in which chunks were consumed."""
    from runtime.kernels import reference

    registry = load_generated(folder).KERNELS
    module = registry.module("latent_up", (group, shape_id))
    ranks, widths = module.ranks, module.out_widths
    g = torch.Generator().manual_seed(seed)  # the same factors on every rank
    ups = tuple(torch.randn(r, n, generator=g) for r, n in zip(ranks, widths, strict=False))
    chunk = module.chunk
    full = torch.randn(m, chunk * world, generator=g)
    full[:, sum(ranks) :] = 0
    local = full[:, rank * chunk : (rank + 1) * chunk].contiguous()
    comm = Comm(count=True)
    order = []

    def chunk_fn(piece, index, us, accs):
        order.append(index)
        module.latent_up_chunk(piece, index, us, accs)

    accs = tuple(torch.zeros(m, u.shape[1]) for u in ups)
    gathered = torch.empty(world, m, chunk)
    module.latent_up(comm, local, gathered, ups, accs, chunk_fn=chunk_fn)
    elements = comm.stats.by_kind["all_gather"].elements
    want = reference.latent_up_gathered(comm.all_gather_columns(local), ups, ranks)
    diff = max((a - w).abs().max().item() for a, w in zip(accs, want, strict=True))
    return diff, order, torch.equal(Comm.columns(gathered), full), elements


def panel_only_gemm(matrices: list[torch.Tensor]):
    """A tuned gemm that multiplies every fp32 matrix of ``matrices`` by the native panel
    form at every row count, with each matrix packed: ``release`` takes all of them."""
    from runtime.kernels.cpu_gemm import DECODE_ROWS, CpuGemm, Form

    panel = dict.fromkeys(DECODE_ROWS, Form("panel"))
    shapes = {(b.shape[0], b.shape[1], b.dtype) for b in matrices if b.dtype == torch.float32}
    gemm = CpuGemm(dict.fromkeys(shapes, panel))
    gemm.pack(matrices)
    return gemm


def run_model(rank, world, spec_text, folder, checkpoint, prompts, runs):
    """Logits of the packed ``prompts`` for each (mode, backend[, up layout[,
    "released"]]), with comm counts; "released": the eager model with every matrix it
    multiplies only whole kept in the panel form alone (``TPModel.release_matrices``)."""
    from runtime.model.transformer import TPModel
    from runtime.model.weights import load_rank_weights

    spec = parse_spec(spec_text)
    registry = load_generated(folder).KERNELS
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], dtype=torch.int32)
    cu = [0]
    for p in prompts:
        cu.append(cu[-1] + len(p))
    results = {}
    for run in runs:
        _, backend, _ = run_parts(run)
        executed, mode_plan = execution_plan(spec, world, run)
        kernels = registry
        if executed != spec:  # its own kernels: the concat-splits lose merged members
            kernels = load_generated(generated_folder(executed, folder + "-none")).KERNELS
        comm = Comm(count=True)
        weights = load_rank_weights(checkpoint, spec, mode_plan, rank, torch.float32)
        execution = execution_for(spec.model, kernels, backend)
        model = TPModel(spec, mode_plan, rank, comm, execution, weights)
        if backend == "eager":
            model.prepare_eager()
        if "released" in run[3:]:
            gemm = panel_only_gemm(model.matrices())
            assert model.release_matrices(gemm.release) > 0
            execution.use(gemm)
        n_valid = torch.tensor([len(ids)], dtype=torch.int32)
        attention = packed_causal_attention(cu)
        batch = execution.batch(positions, n_valid, attention, model.inv_freq)
        logits = model.logits(model.forward(ids, positions, batch))
        results[run] = (logits, {k: s.elements for k, s in comm.stats.by_kind.items()})
    return results


def shm_all_reduce(rank, world, cases, seed):
    """Each case (shape, dtype) twice in a row through ``Comm`` with the shared-memory
    all-reduce (tensors over its 64 KB capacity fall back to gloo) and through gloo
    alone; returns per case (max difference, the result) and whether /dev/shm is clean."""
    import os

    import torch.distributed as dist

    from runtime.dist.shm_collectives import SPINS, SharedMemoryCollectives, supported

    assert supported()
    # both waits: spinning first (a core per rank), yielding at once (ranks share cores)
    shm = SharedMemoryCollectives(rank, world, capacity=1 << 16, spins=SPINS * (seed % 2))
    comm = Comm()
    comm.shm = shm
    out = []
    for i, (shape, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + 97 * i + rank)
        x = torch.randn(shape, generator=g).to(dtype)
        for _ in range(2):  # consecutive calls alternate the two buffers
            got, want = comm.all_reduce(x.clone()), x.clone()
            dist.all_reduce(want)
        out.append(((got.float() - want.float()).abs().max().item(), got))
    gone = not any(n.startswith("deinfer-") for n in os.listdir("/dev/shm"))
    shm.close()
    return out, gone


def mixed_layout_all_reduce(rank, world, shape):
    """Rank r holds (r + 1)·base, rank 0 as a transposed view (what the eager GEMM returns
    for 16 to 64 rows), the others contiguous; the sum through ``Comm`` (gloo, and the
    shared-memory path) must be the logical sum on every rank."""
    from runtime.dist.shm_collectives import SharedMemoryCollectives

    base = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    out = []
    for shm in (False, True):
        x = base * (rank + 1)
        if rank == 0:
            x = x.t().contiguous().t()
        comm = Comm()
        if shm:
            comm.shm = SharedMemoryCollectives(rank, world, capacity=1 << 16)
        comm.all_reduce(x)
        out.append(torch.equal(x, base * (world * (world + 1) // 2)))
        if shm:
            comm.shm.close()
    return out


def tune_gemm_shared(rank, world, shapes_per_rank, budget):
    """``tune_cpu_gemm`` over this rank's shapes, the ranks tuning together: returns the
    chosen forms, the report's counts and this rank's timings by shape."""
    from runtime.kernels.cpu_gemm import choose
    from runtime.kernels.gemm_tuning import tune_cpu_gemm

    torch.manual_seed(rank)
    mats = [torch.randn(n, k).t() for k, n in shapes_per_rank[rank]]  # [K, N] of [N, K]
    timings, report = tune_cpu_gemm(mats, budget, rows=(1, 4), reps=1)
    counts = (report.shapes, report.classes, report.timed, report.timed_here)
    by_shape = {
        key[:2]: {r: {f.name: t for f, t in fs.items()} for r, fs in per_rows.items()}
        for key, per_rows in timings.items()
    }
    return choose(timings).describe(), counts, by_shape


def shm_all_gather(rank, world, cases, seed):
    """Each case (rows, width, dtype): ``Comm.all_gather_columns`` and the chunked
    all-gather (overlap on: through shared memory it is one exchange) with the
    shared-memory collectives, an all-reduce in between (one call sequence for both),
    against gloo's all-gather; tensors over the 64 KB capacity fall back to gloo.
    Returns per case whether both gathers equal gloo's exactly."""
    import torch.distributed as dist

    from runtime.dist.shm_collectives import SharedMemoryCollectives

    comm = Comm()
    comm.shm = SharedMemoryCollectives(rank, world, capacity=1 << 16)
    out = []
    for i, (rows, width, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + 31 * i + rank)
        local = torch.randn(rows, width, generator=g).to(dtype)
        want = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(want, local)
        columns = comm.all_gather_columns(local)
        comm.all_reduce(torch.ones(3))
        chunks = local.new_empty((world, rows, width))
        arrived = dict(comm.all_gather_chunks(local, chunks))
        same = torch.equal(columns, torch.cat(want, dim=1)) and all(
            torch.equal(arrived[j], want[j]) for j in range(world)
        )
        out.append(same and sorted(arrived) == list(range(world)))
    comm.shm.close()
    return out


def packed_causal_attention(cu_seqlens: list[int]):
    """An attention callback for ``runtime.model.layers.Batch`` over a packed batch of
    whole sequences (no cache): tokens of sequence i are rows cu_seqlens[i]:cu_seqlens[i+1]
    of q, k, v, causal within each."""
    import itertools

    from runtime.model.eager_attention import causal_attention

    def attention(index, q, k, v, latent):
        out = q.new_empty(q.shape)
        scale = q.shape[-1] ** -0.5
        for start, stop in itertools.pairwise(cu_seqlens):
            out[start:stop] = causal_attention(
                q[start:stop], k[start:stop], v[start:stop], 0, scale
            )
        return out

    return attention


def core_affinity(rank, world):
    """The cores this rank may run on, after the launcher pinned it."""
    import os

    return sorted(os.sched_getaffinity(0))
