"""The graph-mode entry points: ``ops.shard``, ``Cell.shard``, ``AutoParallel``,
``set_context(mode=GRAPH_MODE)`` and ``compile_count``.

Each wraps a function (or Cell) in a :class:`ShardFunction`, which traces it once per
signature — the shapes, dtypes and layouts of its tensor arguments, its other
arguments, the strategies of the Primitives (any ``shard`` call re-traces) and the
parallel context — compiles the trace (compile.py) and caches the result; calls with
a known signature run the cached graph.
"""
from __future__ import annotations

import copy
import dataclasses

from ... import context
from ..._core._tensor import TensorBase
from ...ops import primitive as _primitive
from ...tensor import Parameter
from ..devices import device_num, live_backend, parallel_active
from ..inputs import distribute_inputs
from ..layout_spec import LayoutSpec
from ..strategy import apply_saved_layouts, is_sharded_layout
from ..strategy_ckpt import layouts_fixed
from .compile import compile_graph
from .trace import TraceError, current_trace, find_parameters, is_cell, trace

__all__ = ["shard", "ShardFunction", "AutoParallel", "compile_count", "graph_call"]

_COMPILES = [0]

_DEVICES = ("CPU", "GPU", "Ascend")
_AUTO_MODES = ("semi_auto", "sharding_propagation", "recursive_programming",
               "dynamic_programming")


def compile_count() -> int:
    """How many graphs this process has compiled (a cached call compiles nothing)."""
    return _COMPILES[0]


def _check_strategy_tuple(owner, param, value, allow_none_entries=True):
    if value is None:
        return None
    if isinstance(value, LayoutSpec):
        value = (value,)
    if not isinstance(value, tuple):
        raise TypeError(f"{owner}: {param} must be a tuple with one strategy (a tuple of ints, "
                        f"a Layout, or None) per input, got {type(value).__name__} {value!r}")
    for i, s in enumerate(value):
        if s is None and allow_none_entries or isinstance(s, LayoutSpec):
            continue
        if not isinstance(s, tuple) or not all(isinstance(v, int) and not isinstance(v, bool)
                                               and v >= 1 for v in s):
            raise ValueError(f"{owner}: {param}[{i}]={s!r} is not a strategy; each entry must "
                             f"be a tuple of positive ints (one per dim), a Layout, or None")
    return value


def _check_parameter_plan(owner, plan):
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise TypeError(f"{owner}: parameter_plan must be a dict {{parameter name: strategy}}, "
                        f"got {type(plan).__name__}")
    for k, s in plan.items():
        if not isinstance(k, str):
            raise TypeError(f"{owner}: parameter_plan key {k!r} must be a parameter name (str)")
        _check_strategy_tuple(owner, f"parameter_plan[{k!r}]", (s,), allow_none_entries=False)
    return dict(plan)


def _arg_key(a):
    if isinstance(a, TensorBase):
        lay = a._layout
        return ("T", tuple(a.shape), a.dtype.str, lay if lay is None or
                lay.__hash__ is not None else id(lay))
    try:
        hash(a)
        return ("V", type(a), a)
    except TypeError:
        return ("I", id(a))


#: bumped whenever ``Cell.set_train`` changes a cell's mode: part of the cache key, as
#: a compiled graph holds the branches (batch or moving statistics, dropout) it traced
TRAIN_EPOCH = [0]


def _context_key():
    st = context._STATE
    ap = st.auto_parallel
    # the parallel mode, gradients_mean, the fusion settings and the parallel optimizer's
    # shape the gradient nodes of a train step (grad_reduce.replica_gradient_scale, fuse.py)
    return (ap.parallel_mode, device_num(), ap.search_mode, ap.dataset_strategy,
            st.algo.fully_use_devices, st.run.mode, _primitive.STRATEGY_EPOCH[0],
            ap.gradients_mean, repr(ap.comm_fusion), repr(ap.all_reduce_fusion_config),
            TRAIN_EPOCH[0], ap.enable_parallel_optimizer, repr(ap.parallel_optimizer_config),
            ap.enable_alltoall)


class _ModeOverride:
    """Run an AutoParallel network in its own parallel mode when the context is
    stand-alone but a multi-device backend is up (as MindSpore's AutoParallel does), and
    with its own search mode (``AutoParallel(parallel_mode="recursive_programming")``
    searches that way whatever the context's ``search_mode``)."""

    def __init__(self, mode, search_mode=None):
        self.mode = mode
        self.search_mode = search_mode
        self.saved = None

    def __enter__(self):
        st = context._STATE
        changes = {}
        if self.mode is not None and st.auto_parallel.parallel_mode == "stand_alone":
            b = live_backend()
            if b is not None and b.world_size > 1:
                changes["parallel_mode"] = self.mode
        if self.search_mode is not None and st.auto_parallel.search_mode != self.search_mode:
            changes["search_mode"] = self.search_mode
        if changes:
            self.saved = st.auto_parallel
            st.auto_parallel = dataclasses.replace(self.saved, **changes)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            context._STATE.auto_parallel = self.saved
            self.saved = None


class ShardFunction:
    """A function compiled to graph mode per input signature (``ops.shard``'s result).

    Calling it runs the compiled graph; ``strategies()`` and ``dump(path)`` describe the
    most recently compiled graph, ``compiled`` is that CompiledGraph.
    """

    def __init__(self, fn, in_strategy=None, out_strategy=None, parameter_plan=None,
                 device="CPU", level=0, *, owner="ops.shard", propagate=True,
                 top_level=False, mode=None, search_mode=None):
        if not callable(fn):
            raise TypeError(f"{owner}: fn must be a function or a Cell, got "
                            f"{type(fn).__name__}")
        if not isinstance(device, str) or device not in _DEVICES:
            raise ValueError(f"{owner}: device={device!r} is not supported; use one of "
                             f"{list(_DEVICES)} (every one runs on the current backend)")
        if isinstance(level, bool) or level != 0:
            raise ValueError(f"{owner}: level={level!r} is not supported; only level=0 "
                             f"(sharding propagation over the whole function) exists")
        self.fn = fn
        self.owner = owner
        self.in_strategy = _check_strategy_tuple(owner, "in_strategy", in_strategy)
        self.out_strategy = _check_strategy_tuple(owner, "out_strategy", out_strategy)
        self.parameter_plan = _check_parameter_plan(owner, parameter_plan)
        self.propagate = propagate
        self.top_level = top_level
        self.mode = mode
        self.search_mode = search_mode
        self._cache = {}
        self.compiled = None
        self._cell = fn if is_cell(fn) else None

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: the same settings over a deep copy of the function (a
        Cell's copy has parameters of its own). The compiled graphs, bound to the
        original's parameters, are not copied: the copy compiles its own when called."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.fn = copy.deepcopy(self.fn, memo)
        new._cell = new.fn if self._cell is not None else None
        new.parameter_plan = copy.deepcopy(self.parameter_plan, memo)
        new._cache = {}
        new.compiled = None
        return new

    # ---- calling ---------------------------------------------------------------------
    def _run_fn(self, *args, **kwargs):
        if self._cell is not None:
            return self._cell.call_construct(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, TensorBase):
                raise TypeError(f"{self.owner}: tensor argument {k!r} was passed by keyword; "
                                f"pass the tensors of a compiled function positionally")
        tr = current_trace()
        if tr is not None:                 # inside another compiled function: inline
            return self._inline(tr, args, kwargs)
        with _ModeOverride(self.mode, self.search_mode):
            sharded = parallel_active() and context._STATE.auto_parallel.parallel_mode in (
                "semi_auto_parallel", "auto_parallel")
            if self.in_strategy is not None and len(self.in_strategy) != len(args):
                raise ValueError(f"{self.owner}: in_strategy has {len(self.in_strategy)} "
                                 f"entries but fn got {len(args)} inputs; give one strategy "
                                 f"(or None) per input")
            if sharded and self.top_level:
                args = distribute_inputs(args)
            key = (tuple(_arg_key(a) for a in args),
                   tuple((k, _arg_key(v)) for k, v in sorted(kwargs.items())),
                   _context_key(), sharded)
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(args, kwargs, sharded)
                self._cache[key] = compiled
            self.compiled = compiled
            return compiled([a for a in args if isinstance(a, TensorBase)
                             and not isinstance(a, Parameter)])

    def _inline(self, tr, args, kwargs):
        """Called while another function is being traced (a GRAPH_MODE cell inside an
        AutoParallel step, an ops.shard block inside another): this function's ops are
        recorded into that trace, its in/out strategies as Redistribute nodes, and the
        outer compile plans them all together."""
        if self.parameter_plan:
            raise TraceError(f"{self.owner}: parameter_plan cannot be applied inside "
                             f"another compiled function; give the parameters' layouts to "
                             f"the outer one (or strategies to the ops using them)")
        if self.in_strategy is not None:
            if len(self.in_strategy) != len(args):
                raise ValueError(f"{self.owner}: in_strategy has {len(self.in_strategy)} "
                                 f"entries but fn got {len(args)} inputs; give one strategy "
                                 f"(or None) per input")
            args = tuple(tr._move(a, s, self.owner, i, "in_strategy")
                         if s is not None and isinstance(a, TensorBase) else a
                         for i, (a, s) in enumerate(zip(args, self.in_strategy)))
        out = self._run_fn(*args, **kwargs)
        if self.out_strategy is not None:
            out = tr.move_outputs(out, self.out_strategy, self.owner, "fn returned")
        return out

    def _compile(self, args, kwargs, sharded):
        for i, a in enumerate(args):
            if isinstance(a, Parameter):
                raise TypeError(f"{self.owner}: argument {i} is a Parameter; parameters are "
                                f"read by the function itself (use parameter_plan to shard "
                                f"them)")
        params = find_parameters(self.fn)
        if sharded:                       # strategy_ckpt_load_file: saved layouts first
            apply_saved_layouts(params, self.owner)
        name = getattr(self.fn, "__name__", None) or type(self.fn).__name__
        graph = trace(self._run_fn, args, kwargs, name=name, params=params)
        in_strategy = self.in_strategy
        if in_strategy is not None:       # entries of non-tensor arguments are dropped
            in_strategy = tuple(s for s, a in zip(in_strategy, args)
                                if isinstance(a, TensorBase))
        sources = {v.id: a._layout for v, a in zip(
            graph.args, [a for a in args if isinstance(a, TensorBase)])}
        fully = context._STATE.algo.fully_use_devices
        # fully_use_devices filters the candidates; the search itself is the context's
        # search_mode (search.py), which AutoParallel's parallel_mode overrides
        compiled = compile_graph(graph, device_num(), sharded=sharded, propagate=self.propagate,
                                 name=self.owner, in_strategy=in_strategy,
                                 out_strategy=self.out_strategy,
                                 parameter_plan=self.parameter_plan, arg_sources=sources,
                                 fully_use_devices=fully)
        _COMPILES[0] += 1
        if sharded:                       # strategy_ckpt_save_file: the planned layouts
            layouts_fixed([(p, lay) for p, lay in compiled.parameter_layouts()
                           if is_sharded_layout(lay)])
        return compiled

    # ---- introspection -----------------------------------------------------------------
    def _last(self):
        if self.compiled is None:
            raise RuntimeError(f"{self.owner}: nothing compiled yet; graphs compile per input "
                               f"signature on the first call, so call the function once first")
        return self.compiled

    def strategies(self, **network) -> dict:
        """The chosen strategy per op of the last compiled graph, and its cost (and its
        predicted communication time given ``link=`` or ``alpha_s``/``beta_s_per_byte``),
        as a :class:`~dualmode.parallel.graph.search.PlanTable`: a dict whose
        ``total_cost``, ``plan_cost`` and ``search_mode`` give the plan's totals."""
        return self._last().strategies(**network)

    def dump(self, path=None, backward=False) -> str:
        """The last compiled graph as graphviz dot text (written to `path` if given);
        ``backward=True`` adds the backward pass derived at compile time."""
        return self._last().dump(path, backward=backward)

    def __repr__(self):
        return f"{self.owner}({getattr(self.fn, '__name__', type(self.fn).__name__)})"


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device="CPU", level=0):
    """Compile `fn` (a function or a Cell) to graph mode with operator-level parallelism.

    The inputs are moved into `in_strategy` (one strategy tuple, Layout or None per
    input), the outputs into `out_strategy`, the named parameters into `parameter_plan`;
    every op inside without a strategy gets one by sharding propagation. The code around
    the call stays eager and data parallel. Returns a callable :class:`ShardFunction`.
    """
    if in_strategy is None:
        raise ValueError("ops.shard: in_strategy is required (a tuple with one strategy, "
                         "Layout or None per input)")
    return ShardFunction(fn, in_strategy, out_strategy, parameter_plan, device, level,
                         owner="ops.shard")


class AutoParallel(ShardFunction):
    """``AutoParallel(fn_or_cell, parallel_mode="semi_auto")``: compile a network or a
    whole training step (forward, ``value_and_grad``, optimizer update) to one graph.

    ``"semi_auto"`` runs the ops' configured strategies and data parallel elsewhere;
    the other modes choose the other ops' strategies with that search, whatever the
    context's ``search_mode``: ``"sharding_propagation"`` (greedy from the configured
    ops), ``"recursive_programming"`` (a fast heuristic, heaviest ops first) or
    ``"dynamic_programming"`` (the exact minimum of the cost model, by graph
    elimination; see :mod:`~dualmode.parallel.graph.search`). Inputs are split as batch
    data per ``dataset_strategy``, as a network's are.
    """

    def __init__(self, network, parallel_mode="semi_auto"):
        if parallel_mode not in _AUTO_MODES:
            raise ValueError(f"AutoParallel: parallel_mode={parallel_mode!r} is not valid; "
                             f"use one of {list(_AUTO_MODES)}")
        self.parallel_mode = parallel_mode
        super().__init__(network, owner="AutoParallel", propagate=parallel_mode != "semi_auto",
                         top_level=True,
                         mode="semi_auto_parallel" if parallel_mode == "semi_auto"
                         else "auto_parallel",
                         search_mode=None if parallel_mode == "semi_auto" else parallel_mode)


def graph_call(cell, inputs, kwargs):
    """``Cell.__call__`` under GRAPH_MODE: the cell compiled whole (cached on it)."""
    fn = cell.__dict__.get("_graph_fn")
    if fn is None:
        auto = context._STATE.auto_parallel.parallel_mode == "auto_parallel"
        fn = ShardFunction(cell, owner=f"{type(cell).__name__}(GRAPH_MODE)", propagate=auto)
        cell.__dict__["_graph_fn"] = fn
    return fn(*inputs, **kwargs)
