"""The layouts a network's parameters get, without running a step (``Model.infer_*``),
and the strategy-file keys of the context (``strategy_ckpt_save_file`` /
``strategy_ckpt_load_file``) applied from the training loop.

``parameter_layouts`` traces the function once on the given inputs and compiles the
trace (the same passes as graph mode: configured strategies, propagation in
``auto_parallel``); a parameter's layout is then its ``parameter_plan`` entry, the
layout it already lives in, or the layout its first consuming op moves it into. Tracing
makes the parameters abstract for its duration and restores them: no weight changes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

from .. import context
from .._core._tensor import TensorBase
from ..parallel.devices import device_num, parallel_active
from ..parallel.graph.compile import compile_graph
from ..parallel.graph.trace import trace
from ..parallel.inputs import distribute_inputs
from ..parallel.tensor_layout import TensorLayout
from ..parallel.strategy import apply_saved_layouts, is_sharded_layout
from ..tensor import Parameter
from .strategy_file import parameter_layout, record_layouts

__all__ = ["parameter_layouts", "save_context_strategy", "apply_context_strategy"]

_SHARDED_MODES = ("semi_auto_parallel", "auto_parallel")


def parameter_layouts(fn, args, params, owner) -> "OrderedDict[str, TensorLayout]":
    """{name: TensorLayout} of `params` when `fn(*args)` runs under the current parallel
    context (replicated over the devices when a parameter is not sharded)."""
    n = device_num()
    found = {}
    mode = context.get_auto_parallel_context("parallel_mode")
    if parallel_active() and mode in _SHARDED_MODES:
        args = distribute_inputs(tuple(args))
        graph = trace(fn, args, name=owner, params=list(params))
        tensors = [a for a in args if isinstance(a, TensorBase)]
        sources = {v.id: a._layout for v, a in zip(graph.args, tensors)}
        compiled = compile_graph(graph, n, sharded=True, propagate=mode == "auto_parallel",
                                 name=owner, arg_sources=sources,
                                 fully_use_devices=context._STATE.algo.fully_use_devices)
        found = {id(p): lay for p, lay in compiled.parameter_layouts() if lay is not None}
    out = OrderedDict()
    for p in params:
        if is_sharded_layout(p._layout):
            out[p.name] = p._layout
        else:
            out[p.name] = found.get(id(p)) or parameter_layout(p, n)
    return out


def save_context_strategy(layouts: Dict[str, TensorLayout], dtypes=None) -> Optional[str]:
    """Record `layouts` in ``strategy_ckpt_save_file`` when the context sets it (merged
    with what this process fixed before: :func:`~.strategy_file.record_layouts`)."""
    return record_layouts(layouts, dtypes)


def apply_context_strategy(params, owner) -> Dict[str, TensorLayout]:
    """Store each parameter not laid out yet in its layout from
    ``strategy_ckpt_load_file`` (when the context sets it), so that the ops and compiled
    graphs that use it find it in the saved layout. Returns the layouts applied."""
    if not parallel_active() or \
            context.get_auto_parallel_context("parallel_mode") not in _SHARDED_MODES:
        return {}
    return apply_saved_layouts(params, owner)


def network_parameters(*cells) -> list:
    """The Parameters of `cells` (and their optimizers' states), each once, in order."""
    seen, out = set(), []
    for cell in cells:
        if cell is None:
            continue
        for p in cell.get_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return [p for p in out if isinstance(p, Parameter)]
