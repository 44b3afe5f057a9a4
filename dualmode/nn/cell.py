"""Cell: the base class of every layer and network (MindSpore's ``nn.Cell``).

A Cell registers, in assignment order, the Parameters and child Cells set as its
attributes. Parameter names follow MindSpore's ``auto_prefix``: a Parameter created
without a name is named after its attribute, and when a Cell is attached to a parent
its parameters' names get the attribute path as prefix (``net.fc1.weight`` is named
``"fc1.weight"``). Registered values also live in the instance ``__dict__`` so
reading ``self.weight`` inside ``construct`` costs a plain attribute lookup.
"""
from __future__ import annotations

import copy
import types
from collections import OrderedDict

from .. import context
from ..parallel.devices import parallel_active
from ..parallel.inputs import distribute_inputs
from ..parallel.pipeline import RUNNING as _PIPELINE_RUNNING
from ..parallel.pipeline import check_outside_run
from ..parallel.graph import api as _graph_api
from ..parallel.graph.api import ShardFunction, graph_call
from ..tensor import Parameter

__all__ = ["Cell"]


def _check_child_name(owner, kind, name):
    if not isinstance(name, str) or not name:
        raise TypeError(f"{owner}: a {kind} name must be a non-empty str, got {name!r}")
    if "." in name:
        raise ValueError(f"{owner}: {kind} name {name!r} must not contain '.'")


#: what a Cell keeps compiled for itself: ``graph_call``'s cache (dropped by a copy, which
#: compiles its own) and ``Cell.shard``'s function (made again for the copy)
_COMPILED = ("_graph_fn", "_shard_fn")


def _deepcopy_attr(owner, name, value, memo):
    """A deep copy of the attribute `name` of a cell (through `memo`). A function that
    closes over values (a ``value_and_grad`` of the network, ...) is made again over
    deep copies of them, so the copied cell's function works on the copied network (the
    copy module would share the function, still working on the original's)."""
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return copy.deepcopy(value, memo)
    found = memo.get(id(value))
    if found is not None:
        return found
    try:
        cells = tuple(types.CellType(copy.deepcopy(c.cell_contents, memo))
                      for c in value.__closure__)
        fn = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                                value.__defaults__, cells)
        fn.__kwdefaults__ = value.__kwdefaults__
        fn.__dict__.update(copy.deepcopy(value.__dict__, memo))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{owner}: copy.deepcopy cannot copy attribute {name!r}, the function "
                        f"{value.__qualname__} closing over values that cannot be copied "
                        f"({e}); make it in construct, or from attributes of the cell") from None
    memo[id(value)] = fn
    return fn


class _CALLS:
    """How many Cell calls are running (0 = the next call is a top-level one)."""

    depth = 0


class Cell:
    """Base class of all neural-network layers and networks.

    Subclasses define ``construct(*inputs)``; calling the cell runs it. Parameters and
    child cells assigned as attributes are registered in order.

    Parameters
    ----------
    auto_prefix : bool
        Prefix the parameter names of the child cells attached to this cell with
        their attribute path (MindSpore default ``True``; wrappers such as
        ``WithLossCell`` use ``False`` so the backbone's names stay unchanged).
    flags : dict, optional
        Extra attributes set on the cell.

    Attributes
    ----------
    training : bool
        Training mode (``set_train``); False by default, as in MindSpore.
    """

    def __init__(self, auto_prefix: bool = True, flags: dict | None = None):
        d = self.__dict__
        d["_params"] = OrderedDict()
        d["_cells"] = OrderedDict()
        d["_auto_prefix"] = bool(auto_prefix)
        d["training"] = False
        d["requires_grad"] = False
        if flags:
            for k, v in flags.items():
                setattr(self, k, v)

    # ---- the computation -------------------------------------------------------
    def construct(self, *inputs, **kwargs):
        """The forward computation; subclasses override it."""
        raise NotImplementedError(f"{type(self).__name__}: a Cell subclass must define "
                                  f"construct(...)")

    def __call__(self, *inputs, **kwargs):
        d = self.__dict__
        shard_fn = d.get("_shard_fn")
        if shard_fn is not None:                   # Cell.shard: this cell runs as a graph
            return shard_fn(*inputs, **kwargs)
        if "_pipeline_stage" in d and not _PIPELINE_RUNNING[0]:
            check_outside_run(self)                # a stage's cell outside PipelineCell
        if _CALLS.depth == 0:
            if inputs and parallel_active():
                inputs = distribute_inputs(inputs)     # network inputs are batch data
            if context._STATE.run.mode == context.GRAPH_MODE \
                    and not getattr(self, "_eager_only", False):
                return graph_call(self, inputs, kwargs)
        # as call_construct (inlined: one frame less per layer)
        _CALLS.depth += 1
        try:
            return self.construct(*inputs, **kwargs)
        finally:
            _CALLS.depth -= 1

    def call_construct(self, *inputs, **kwargs):
        """Run ``construct`` as a call inside a network (not a top-level one: its inputs
        are not split as batch data again)."""
        _CALLS.depth += 1
        try:
            return self.construct(*inputs, **kwargs)
        finally:
            _CALLS.depth -= 1

    def shard(self, in_strategy, out_strategy=None, parameter_plan=None, device="CPU",
              level=0):
        """Run this cell as a compiled graph with operator-level parallelism: its inputs
        in `in_strategy`, outputs in `out_strategy`, parameters per `parameter_plan`, the
        strategies of the ops inside chosen by sharding propagation; the code around it
        stays eager and data parallel. Later calls of the cell run the graph; returns
        the compiled function."""
        if in_strategy is None:
            raise ValueError(f"{type(self).__name__}.shard: in_strategy is required (a tuple "
                             f"with one strategy, Layout or None per input)")
        fn = ShardFunction(self, in_strategy, out_strategy, parameter_plan, device, level,
                           owner=f"{type(self).__name__}.shard")
        self.__dict__["_shard_fn"] = fn
        return fn

    @property
    def pipeline_stage(self) -> int:
        """The pipeline stage this cell runs on (``-1``: not set; then it runs on the
        stage of the cell around it, or, outside every staged cell, on the stage whose
        output it reads). See ``nn.PipelineCell`` and the context key
        ``pipeline_stages``."""
        return self.__dict__.get("_pipeline_stage", -1)

    @pipeline_stage.setter
    def pipeline_stage(self, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{self.cls_name}: pipeline_stage must be an int, got "
                            f"{type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"{self.cls_name}: pipeline_stage={value} is not valid; "
                             f"expected an int >= 0 (a stage index below pipeline_stages)")
        self.__dict__["_pipeline_stage"] = value

    @property
    def cls_name(self) -> str:
        """The class name (MindSpore's ``Cell.cls_name``)."""
        return type(self).__name__

    # ---- attribute registration -----------------------------------------------
    def _registry(self):
        params = self.__dict__.get("_params")
        if params is None:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() before "
                                 f"assigning attributes")
        return params, self.__dict__["_cells"]

    def __setattr__(self, name, value):
        params, cells = self._registry()
        if isinstance(value, Parameter):
            if name in cells:
                raise TypeError(f"{self.cls_name}: attribute {name!r} holds a child Cell; "
                                f"cannot assign the Parameter {value.name!r} to it")
            self.insert_param_to_cell(name, value)
        elif isinstance(value, Cell):
            if name in params:
                raise TypeError(f"{self.cls_name}: attribute {name!r} holds a Parameter; "
                                f"cannot assign the Cell {value.cls_name} to it")
            self.insert_child_to_cell(name, value)
        elif name in params:
            if value is not None:
                raise TypeError(f"{self.cls_name}: attribute {name!r} holds the Parameter "
                                f"{params[name].name!r}; cannot assign a "
                                f"{type(value).__name__} to it (assign a Parameter, or "
                                f"change its value with .set_data(...))")
            del params[name]
            object.__setattr__(self, name, None)
        elif name in cells:
            if value is not None:
                raise TypeError(f"{self.cls_name}: attribute {name!r} holds a child Cell; "
                                f"cannot assign a {type(value).__name__} to it")
            del cells[name]
            object.__setattr__(self, name, None)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        params, cells = self._registry()
        params.pop(name, None)
        cells.pop(name, None)
        object.__delattr__(self, name)

    def insert_param_to_cell(self, param_name: str, param: Parameter,
                             check_name_contain_dot: bool = True):
        """Register `param` under `param_name` (naming it so when it has no name)."""
        owner = self.cls_name
        if check_name_contain_dot:
            _check_child_name(owner, "parameter", param_name)
        if not isinstance(param, Parameter):
            raise TypeError(f"{owner}: insert_param_to_cell({param_name!r}) expects a "
                            f"Parameter, got {type(param).__name__}")
        params, _ = self._registry()
        if param.name is None:
            param.name = param_name
        params[param_name] = param
        object.__setattr__(self, param_name, param)

    def insert_child_to_cell(self, child_name: str, child_cell: "Cell"):
        """Register `child_cell` under `child_name` (prefixing its parameter names)."""
        owner = self.cls_name
        _check_child_name(owner, "child cell", child_name)
        if not isinstance(child_cell, Cell):
            raise TypeError(f"{owner}: child cell {child_name!r} must be a Cell, got "
                            f"{type(child_cell).__name__}")
        _, cells = self._registry()
        if self._auto_prefix:
            known = {id(p) for _, p in self.parameters_and_names()}
            child_cell.update_parameters_name(child_name + ".", skip=known)
        cells[child_name] = child_cell
        object.__setattr__(self, child_name, child_cell)

    def update_parameters_name(self, prefix: str = "", recurse: bool = True, skip=()):
        """Rename every parameter to `prefix` + its attribute path in this cell.

        Parameters whose ``id`` is in `skip` (already named elsewhere in the parent's
        tree: shared parameters) keep their name.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"{self.cls_name}: prefix must be a str, got {prefix!r}")
        for name, param in self.parameters_and_names(expand=recurse):
            if id(param) not in skip:
                param.name = prefix + name

    # ---- traversal -------------------------------------------------------------
    def cells_and_names(self, cells=None, name_prefix: str = ""):
        """Yield ``(dotted name, cell)`` for this cell and every descendant, once each."""
        seen = cells if cells is not None else set()
        if id(self) in seen:
            return
        seen.add(id(self))
        yield name_prefix, self
        for name, cell in self._cells.items():
            child_prefix = f"{name_prefix}.{name}" if name_prefix else name
            yield from cell.cells_and_names(seen, child_prefix)

    def name_cells(self) -> "OrderedDict[str, Cell]":
        """The direct child cells by attribute name."""
        return OrderedDict(self._cells)

    def cells(self):
        """The direct child cells."""
        return list(self._cells.values())

    def parameters_and_names(self, name_prefix: str = "", expand: bool = True):
        """Yield ``(dotted attribute path, parameter)``; a shared parameter once.

        Parameters
        ----------
        name_prefix : str
            Prepended (with a dot) to every name.
        expand : bool
            Include the parameters of descendant cells (else only this cell's own).
        """
        cells = self.cells_and_names(name_prefix=name_prefix) if expand \
            else ((name_prefix, self),)
        seen = set()
        for cell_name, cell in cells:
            for name, param in cell._params.items():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{cell_name}.{name}" if cell_name else name), param

    def get_parameters(self, expand: bool = True):
        """Yield every parameter once (descendants' too when `expand`)."""
        for _, param in self.parameters_and_names(expand=expand):
            yield param

    def trainable_params(self, recurse: bool = True) -> list:
        """Parameters with ``requires_grad=True``, in registration order."""
        return [p for p in self.get_parameters(expand=recurse) if p.requires_grad]

    def untrainable_params(self, recurse: bool = True) -> list:
        """Parameters with ``requires_grad=False``."""
        return [p for p in self.get_parameters(expand=recurse) if not p.requires_grad]

    def parameters_dict(self, recurse: bool = True) -> "OrderedDict[str, Parameter]":
        """``OrderedDict`` of parameter name (``param.name``) -> parameter."""
        return OrderedDict((p.name, p) for p in self.get_parameters(expand=recurse))

    def set_param_ps(self, recurse: bool = True, init_in_server: bool = False) -> "Cell":
        """Hold every trainable weight of this cell (and its descendants when `recurse`)
        on the parameter servers (``Parameter.set_param_ps``); returns self. A weight
        that cannot take `init_in_server` is refused before any is marked."""
        params = [p for p in self.get_parameters(expand=recurse) if p.requires_grad]
        for param in params:
            param._check_param_ps(init_in_server)
        for param in params:
            param.set_param_ps(init_in_server)
        return self

    # ---- copying -----------------------------------------------------------------
    def __copy__(self):
        """``copy.copy``: a new cell holding the same parameters, child cells and other
        attributes, in registries of its own (assigning an attribute of the copy leaves
        the original as it is)."""
        return self._copied(None)

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: an independent cell: deep copies of its parameters (same
        names, values, layouts and flags; see ``Parameter.__deepcopy__``), child cells
        and other attributes, a parameter shared by several cells shared by their copies
        too. It computes what the original computes; updating one (``set_data``, an
        optimizer step) leaves the other as it is."""
        return self._copied(memo)

    def _copied(self, memo):
        """The copy of this cell: attributes shared when `memo` is None (the registries
        copied), else deep-copied through `memo`. Compiled state is not copied: the copy
        compiles its own graph when called, with the same ``shard`` settings."""
        new = type(self).__new__(type(self))
        if memo is not None:
            memo[id(self)] = new
        attrs = new.__dict__
        for name, value in self.__dict__.items():
            if name in _COMPILED:
                continue
            if memo is not None:
                attrs[name] = _deepcopy_attr(self.cls_name, name, value, memo)
            else:
                attrs[name] = OrderedDict(value) if name in ("_params", "_cells") else value
        shard_fn = self.__dict__.get("_shard_fn")
        if shard_fn is not None:
            new.shard(shard_fn.in_strategy, shard_fn.out_strategy, shard_fn.parameter_plan)
        return new

    # ---- modes -------------------------------------------------------------------
    def set_train(self, mode: bool = True) -> "Cell":
        """Set training mode on this cell and every descendant; returns self."""
        if not isinstance(mode, bool):
            raise TypeError(f"{self.cls_name}: set_train(mode) needs a bool, got {mode!r}")
        for _, cell in self.cells_and_names():
            if cell.__dict__.get("training") != mode:
                cell.__dict__["training"] = mode
                _graph_api.TRAIN_EPOCH[0] += 1      # compiled graphs traced before: re-trace
        return self

    def set_grad(self, requires_grad: bool = True) -> "Cell":
        """Mark the cell as differentiated (kept for MindSpore compatibility)."""
        self.__dict__["requires_grad"] = bool(requires_grad)
        return self

    # ---- printing ----------------------------------------------------------------
    def extend_repr(self) -> str:
        """Extra text shown in ``repr`` (layers override it)."""
        return ""

    def __repr__(self):
        extra = self.extend_repr()
        info = self.cls_name + "<"
        if self._cells:
            body = "\n"
            if extra:
                body += extra + "\n"
            for key, cell in self._cells.items():
                body += f"({key}): {cell!r}\n"
            info += body.replace("\n", "\n  ") + ">"
        else:
            info += extra + ">"
        return info
