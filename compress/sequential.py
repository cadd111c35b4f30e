"""Sequential calibration: each layer's factors made from the inputs that the layers
below it, already compressed, produce, instead of the dense model's (error-propagation
aware, as in GPTQ and SVD-LLM V2's sequential variant).

Two streams of hidden states run through the model one decoder layer at a time: the
dense one (X, the inputs the dense model sees) and the compressed one (X', the inputs
the compressed model will see). Within a layer the groups of matrices that read one
input (q/k/v, o, gate/up, down; fc1, fc2) are factorised in order, each from the
statistics of its input in the compressed layer after the groups before it were
replaced, so o sees the compressed attention's output and down the compressed MLP's.
With ``refit`` each up factor is then refitted to the dense outputs (X·W) given its
down factor and X' (``compress.factorize.refit_up``).

The layer is called directly with the keyword arguments the model passed it (masks,
position embeddings), captured once per sequence length; sequences of one length run
as one batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from tqdm import tqdm

from compress.calibration import INPUT_OF, by_length
from compress.factorize import InputStats, factorize
from dsl import Spec
from runtime.model.checkpoint import names_for

Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, m) -> D, U


class _Stop(Exception):
    """Raised by a hook once it has what it needs: the rest of the forward is skipped."""


@dataclass
class _Batch:
    dense: torch.Tensor  # hidden states into the current layer, dense stream
    compressed: torch.Tensor  # the same, compressed stream
    kwargs: dict  # what the model passes every decoder layer (mask, positions, ...)


@torch.inference_mode()
def sequential_factors(
    model,
    spec: Spec,
    sequences: list[list[int]],
    method: str,
    alpha: float = 0.5,
    refit: bool = False,
    progress: bool = True,
    column_scales: dict[tuple[int, str], torch.Tensor] | None = None,
) -> Factors:
    """D, U of every decomposed matrix of ``spec``, layer by layer from the compressed
    stream's inputs (output columns weighted by ``column_scales``, ``--fisher``).
    ``model`` (the dense transformers model) is left unchanged."""
    names = names_for(spec.model)
    prefix = names.layer_prefix.rstrip(".")
    batches = _first_layer_inputs(model, f"{prefix}.0", sequences)
    groups = _groups(spec.model.matrices)
    factors: Factors = {}
    layers = spec.decomposition.layers
    for i, ranks in enumerate(tqdm(layers, desc="sequential", unit="layer", disable=not progress)):
        dense_layer = model.get_submodule(f"{prefix}.{i}")
        layer = copy.deepcopy(dense_layer)  # the compressed copy; the model keeps its own
        wanted = [first for first, members in groups if any(ranks.rank(m) for m in members)]
        dense_inputs = _dense_inputs(dense_layer, names, wanted, batches)
        for first, members in groups:
            todo = [m for m in members if ranks.rank(m) is not None]
            if not todo:
                continue
            stats = _compressed_stats(layer, names, first, batches, dense_inputs[first])
            for m in todo:
                module = layer.get_submodule(names.modules[m])
                w = module.weight.data.t()  # math layout [in, out]
                scale = column_scales[(i, m)] if column_scales else None
                d, u = factorize(w, ranks.rank(m), method, stats, alpha, refit, scale)
                factors[(i, m)] = (d, u)
                module.weight.data = (d @ u).t().to(module.weight.dtype).contiguous()
        for batch in batches:
            batch.dense = _output(dense_layer(batch.dense, **batch.kwargs))
            batch.compressed = _output(layer(batch.compressed, **batch.kwargs))
    return factors


def _groups(matrices: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(input owner, its matrices) in the order the layer computes them."""
    out: dict[str, list[str]] = {}
    for m in matrices:
        out.setdefault(INPUT_OF[m], []).append(m)
    return list(out.items())


def _output(result):
    return result[0] if isinstance(result, tuple) else result


def _first_layer_inputs(model, layer_name: str, sequences: list[list[int]]) -> list[_Batch]:
    """One batch per sequence length: the hidden states entering the first decoder layer
    and the keyword arguments the model gives every layer."""
    layer = model.get_submodule(layer_name)
    batches = []
    for group in by_length(sequences):
        seen: dict = {}

        def capture(module, args, kwargs, seen=seen):
            seen["hidden"] = args[0] if args else kwargs.pop("hidden_states")
            seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            raise _Stop

        handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            model(input_ids=torch.tensor(group), use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
        hidden = seen["hidden"]
        batches.append(_Batch(hidden, hidden.clone(), seen["kwargs"]))
    return batches


def _dense_inputs(
    layer, names, firsts: list[str], batches: list[_Batch]
) -> dict[str, list[torch.Tensor]]:
    """The inputs of each group's first matrix in the dense layer, one tensor per batch."""
    out: dict[str, list[torch.Tensor]] = {first: [] for first in firsts}
    handles = []
    for first in firsts:
        module = layer.get_submodule(names.modules[first])
        handles.append(
            module.register_forward_pre_hook(lambda mod, args, f=first: out[f].append(args[0]))
        )
    try:
        for batch in batches:
            layer(batch.dense, **batch.kwargs)
    finally:
        for h in handles:
            h.remove()
    return out


def _compressed_stats(
    layer, names, first: str, batches: list[_Batch], dense: list[torch.Tensor]
) -> InputStats:
    """Statistics of ``first``'s input in the (partly) compressed layer, with the cross
    Gram matrix against the dense layer's input of the same tokens."""
    module = layer.get_submodule(names.modules[first])
    stats = InputStats(module.in_features, cross=True)
    for batch, x_dense in zip(batches, dense, strict=True):

        def hook(mod, args, x_dense=x_dense):
            stats.add(args[0], x_dense)
            raise _Stop

        handle = module.register_forward_pre_hook(hook)
        try:
            layer(batch.compressed, **batch.kwargs)
        except _Stop:
            pass
        finally:
            handle.remove()
    return stats
