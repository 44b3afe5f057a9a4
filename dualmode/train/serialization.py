"""Saving and loading checkpoints: ``save_checkpoint``, ``load_checkpoint``,
``load_param_into_net`` (MindSpore's names, exported at the top level of dualmode).

What a Cell saves: every Parameter in its tree (named by ``Parameter.name``) and, for
every optimizer in the tree, its state Parameters (``moments.<name>``,
``moment1.<name>``, ...) and its step counter (``global_step``, which is also the
position of a learning-rate schedule). So saving a cell that holds the network and its
optimizer (``TrainOneStepCell``, or ``[network, optimizer]``) saves both, and
``load_param_into_net(optimizer, params)`` restores the optimizer.

Sharded parameters: ``integrated_save=True`` writes each one's global value (under
MPI every rank takes part in the gather and rank 0 writes); ``integrated_save=False``
writes the slices each device holds, one file per rank (``<dir>/rank_<r>/<name>``),
and the strategy file ``<dir>/strategy.json``, with no gather.

Loading checks everything first (file header and checksums, names, shapes, dtypes),
builds the new storage of every parameter (only the local shards of a sharded one),
and then swaps them all in: an error leaves the network exactly as it was.
"""
from __future__ import annotations

import numbers
import os
from collections import OrderedDict
from typing import Dict, List

import numpy as np

from .._core._tensor import TensorBase
from ..nn.cell import Cell
from ..nn.optim.optimizer import Optimizer
from ..parallel.devices import live_backend, some_devices
from ..parallel.pipeline import first_stage_values, stage_files
from ..parallel.tensor_layout import TensorLayout
from ..tensor import Parameter
from .safetensors_io import CheckpointFile, write_file, write_files
from .strategy_file import (layout_from_dict, layout_to_dict, record_layouts,
                            save_strategy_file)

__all__ = ["save_checkpoint", "load_checkpoint", "load_param_into_net", "checkpoint_entries",
           "sliced_path", "STEP_NAME"]

#: the name an optimizer's step counter is saved under (MindSpore's)
STEP_NAME = "global_step"


# ---------------------------------------------------------------------------------
# what a network saves
# ---------------------------------------------------------------------------------
class StepCounter:
    """An optimizer's ``global_step`` seen as a checkpoint entry (an int64 scalar)."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer):
        self.optimizer = optimizer

    shape = ()
    dtype = np.dtype(np.int64)

    def value(self) -> np.ndarray:
        return np.array(self.optimizer.global_step, np.int64)


def _optimizer_entries(opt):
    """(name, Parameter) of an optimizer's weights and states, in order."""
    for p in opt.parameters:
        yield p.name, p
    for prefix in opt.__dict__.get("_state_names", ()):
        for st in getattr(opt, prefix):
            yield st.name, st


def checkpoint_entries(save_obj, owner="save_checkpoint") -> "OrderedDict[str, object]":
    """{name: Parameter | StepCounter | array} of what `save_obj` saves: a Cell (its
    parameters, and its optimizers' states and step), a Parameter list, a list of
    Cells, or a dict {name: Parameter | Tensor | array}."""
    out: "OrderedDict[str, object]" = OrderedDict()
    seen: Dict[int, str] = {}
    steps: List[str] = []

    def add(name, obj, where):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{owner}: {where} has no name ({name!r}); every saved "
                             f"parameter needs a unique name")
        if id(obj) in seen:
            return
        if name in out:
            raise ValueError(f"{owner}: two different parameters are named {name!r}; "
                             f"checkpoint names must be unique (rename one)")
        seen[id(obj)] = name
        out[name] = obj

    def add_cell(cell, where):
        for _, p in cell.parameters_and_names():
            add(p.name, p, f"{where}: parameter {p!r}")
        for path, sub in cell.cells_and_names():
            if isinstance(sub, Optimizer):
                for name, p in _optimizer_entries(sub):
                    add(name, p, f"{where}: optimizer {type(sub).__name__} state {p!r}")
                steps.append(path or type(sub).__name__)
                if len(steps) > 1:
                    raise ValueError(f"{owner}: {where} holds two optimizers ({steps[0]!r} "
                                     f"and {steps[1]!r}); their step counters would both be "
                                     f"saved as {STEP_NAME!r}; save them separately")
                out[STEP_NAME] = StepCounter(sub)

    if isinstance(save_obj, Cell):
        add_cell(save_obj, "the network")
    elif isinstance(save_obj, dict):
        for name, v in save_obj.items():
            if not isinstance(v, (TensorBase, np.ndarray, numbers.Number)) or \
                    isinstance(v, bool):
                raise TypeError(f"{owner}: save_obj[{name!r}] is a {type(v).__name__}; a dict "
                                f"maps names to Parameters, Tensors or numpy arrays")
            add(name, v, f"save_obj[{name!r}]")
    elif isinstance(save_obj, (list, tuple)):
        for i, v in enumerate(save_obj):
            if isinstance(v, Cell):
                add_cell(v, f"save_obj[{i}]")
            elif isinstance(v, Parameter):
                add(v.name, v, f"save_obj[{i}]")
            else:
                raise TypeError(f"{owner}: save_obj[{i}] is a {type(v).__name__}; a list "
                                f"holds Parameters or Cells")
    else:
        raise TypeError(f"{owner}: save_obj must be a Cell, a list of Parameters/Cells or a "
                        f"dict {{name: Parameter}}, got {type(save_obj).__name__}")
    return out


def _state_names(save_obj) -> dict:
    """{optimizer state prefix: [saved names]} of the optimizers in `save_obj`."""
    cells = [save_obj] if isinstance(save_obj, Cell) else \
        [c for c in save_obj if isinstance(c, Cell)] if isinstance(save_obj, (list, tuple)) \
        else []
    out = {}
    for cell in cells:
        for _, sub in cell.cells_and_names():
            if isinstance(sub, Optimizer):
                for prefix in sub.__dict__.get("_state_names", ()):
                    out[prefix] = [st.name for st in getattr(sub, prefix)]
    return out


def _device_count() -> int:
    b = live_backend()
    return b.world_size if b is not None else 1


def _local_ranks(n: int) -> np.ndarray:
    """The ranks of an `n`-device layout whose shards this process stores."""
    b = live_backend()
    if b is not None and b.world_size == n:
        return np.asarray(b.local_ranks, np.int64)
    return np.arange(n, dtype=np.int64)


def _is_device_local(obj) -> bool:
    return isinstance(obj, TensorBase) and obj._layout is not None and \
        not isinstance(obj._layout, TensorLayout)


def _step_of(entries):
    s = entries.get(STEP_NAME)
    return int(s.optimizer.global_step) if isinstance(s, StepCounter) else None


def sliced_path(path: str, rank: int) -> str:
    """Where rank `rank`'s slices of checkpoint `path` go: ``<dir>/rank_<r>/<name>``."""
    d, base = os.path.split(os.fspath(path))
    return os.path.join(d, f"rank_{rank}", base)


# ---------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------
def _check_path(owner, path, what="ckpt_file_name"):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{owner}: {what} must be a file path (str), got {path!r}")
    return os.fspath(path)


def save_checkpoint(save_obj, ckpt_file_name, integrated_save=True, append_dict=None):
    """Save the parameters of `save_obj` to `ckpt_file_name` (safetensors).

    Parameters
    ----------
    save_obj : Cell, list of Parameters or Cells, or dict {name: Parameter | Tensor | array}
        A Cell saves its parameters and, for each optimizer in it, the optimizer's
        states and ``global_step``.
    ckpt_file_name : str
        The file. With ``integrated_save=False`` the slices of rank r go to
        ``<dir>/rank_<r>/<basename>`` and the strategy file to ``<dir>/strategy.json``.
    integrated_save : bool
        True: every sharded parameter is saved as its global value (rank 0 writes under
        MPI); False: each rank writes only the slices its device holds.
    append_dict : dict {str: int | float | array}, optional
        Extra values saved beside the parameters (e.g. ``{"epoch_num": 3}``).

    The write is atomic (temporary file, fsync, rename).
    """
    owner = "save_checkpoint"
    path = _check_path(owner, ckpt_file_name)
    if not isinstance(integrated_save, bool):
        raise TypeError(f"{owner}: integrated_save must be a bool, got {integrated_save!r}")
    entries = checkpoint_entries(save_obj, owner)
    if append_dict is not None:
        if not isinstance(append_dict, dict):
            raise TypeError(f"{owner}: append_dict must be a dict {{name: value}}, got "
                            f"{type(append_dict).__name__}")
        for k, v in append_dict.items():
            if not isinstance(k, str) or k in entries:
                raise ValueError(f"{owner}: append_dict key {k!r} must be a str naming no "
                                 f"saved parameter")
            arr = np.asarray(v)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"{owner}: append_dict[{k!r}]={v!r} is not a number or numeric "
                                f"array")
            entries[k] = arr
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise FileNotFoundError(f"{owner}: the directory of {path!r} does not exist")
    n = _device_count()
    meta = {"kind": "integrated" if integrated_save else "slice",
            "step": _step_of(entries), "optimizer_states": _state_names(save_obj),
            "device_num": n,
            "layouts": {name: layout_to_dict(v._layout) for name, v in entries.items()
                        if isinstance(v, TensorBase) and isinstance(v._layout, TensorLayout)}}
    if integrated_save:
        _save_integrated(path, entries, meta)
    else:
        _save_sliced(path, entries, meta, n)


def _value(name, v, owner):
    if isinstance(v, StepCounter):
        return v.value()
    if _is_device_local(v):
        raise ValueError(f"{owner}: parameter {name!r} is layerwise_parallel with per-device "
                         f"values (no global value to integrate); save with "
                         f"integrated_save=False")
    if isinstance(v, Parameter):
        return v._current()           # a stale parameter server copy is pulled first
    return v._value() if isinstance(v, TensorBase) else np.asarray(v)


def _save_integrated(path, entries, meta):
    # every rank takes part in the gathers (in the same order); rank 0 writes
    tensors = [(name, _value(name, v, "save_checkpoint")) for name, v in entries.items()]
    # pipeline stages on their own processes: the first stage's gets every stage's values
    tensors, first = first_stage_values(tensors, entries)
    b = live_backend()
    writer = first and (b is None or not some_devices() or 0 in b.local_ranks)
    if writer:
        write_file(path, tensors, meta)
    if b is not None and some_devices():  # the file exists for every rank afterwards
        (getattr(b, "world", None) or b).barrier()


def _piece(slot, layout, rank):
    """The part of device `rank`'s `slot` it really holds: the slot itself, or, in a
    `layout` whose splits do not divide, its rows without the pads."""
    if layout is None:
        return slot
    return slot[tuple(slice(0, int(m)) for m in layout.local_shapes[rank])]


def _save_sliced(path, entries, meta, n):
    b = live_backend()
    # with pipeline stages: one file per world rank, each with its stage's entries
    files = stage_files(entries)
    if files is None:
        ranks = tuple(b.local_ranks) if b is not None else (0,)
        files = [(rank, k, None, rank, list(entries)) for k, rank in enumerate(ranks)]
    saved = {name for *_, names in files for name in names}
    layouts = {}
    shared = {}                          # name -> value of a parameter stored whole
    per_device = {}                      # name -> (stack of this process's devices, uneven)
    for name, v in entries.items():
        if name not in saved:            # another stage's, saved by its own processes
            continue
        lay = v._layout if isinstance(v, TensorBase) else None
        if lay is not None and lay.device_num != n:
            raise ValueError(f"save_checkpoint: parameter {name!r} is laid out over "
                             f"{lay.device_num} devices but {n} are running")
        if isinstance(lay, TensorLayout) or _is_device_local(v):
            per_device[name] = (v._data, lay if isinstance(lay, TensorLayout) and
                                not lay.even else None)
            if isinstance(lay, TensorLayout):
                layouts[name] = lay
        else:
            shared[name] = _value(name, v, "save_checkpoint")
    for rank, *_ in files:
        os.makedirs(os.path.dirname(sliced_path(path, rank)), exist_ok=True)

    def file_meta(rank, stage, stage_rank, names):
        if stage is None:
            return dict(meta, rank=int(rank))
        # a stage's entries laid out over its devices; the file's rank is the world's
        return dict(meta, rank=int(rank), stage=stage, stage_rank=stage_rank,
                    stages=b.stages, device_num=b.world.world_size,
                    layouts={k: d for k, d in meta["layouts"].items() if k in names})

    def piece(name, k, stage_rank):
        if name in shared:
            return shared[name]
        stack, uneven = per_device[name]
        return _piece(stack[k], uneven, stage_rank)

    # each rank's slices are views of the stacks (written from their memory); every file
    # is written before the first is synced, so the disk flushes while the next is written
    # a split that does not divide: each rank writes its own piece (its slot's real rows)
    write_files([(sliced_path(path, rank), [(name, piece(name, k, stage_rank))
                                            for name in names],
                  file_meta(rank, stage, stage_rank, names))
                 for rank, k, stage, stage_rank, names in files])
    if files[0][2] is None and 0 in (rank for rank, *_ in files):
        # (with pipeline stages each file's header holds its stage's layouts instead)
        dtypes = {name: entries[name].dtype for name in layouts}
        save_strategy_file(os.path.join(os.path.dirname(os.path.abspath(path)),
                                        "strategy.json"), layouts, dtypes)
        record_layouts(layouts, dtypes)          # strategy_ckpt_save_file, when set
    if b is not None and some_devices():
        (getattr(b, "world", None) or b).barrier()


# ---------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------
def _wrap(arr: np.ndarray, name: str) -> Parameter:
    """A Parameter holding `arr` itself (no copy)."""
    p = Parameter(np.zeros((), arr.dtype), name=name, requires_grad=arr.dtype.kind == "f")
    p._data = arr
    p._shape = tuple(arr.shape)
    p._dtype = arr.dtype
    return p


def load_checkpoint(ckpt_file_name, net=None, strict_load=False, filter_prefix=None):
    """Read a checkpoint file into ``{name: Parameter}`` (every tensor verified).

    Parameters
    ----------
    ckpt_file_name : str
    net : Cell, optional
        Also load the values into `net` (``load_param_into_net``).
    strict_load : bool
        Passed to ``load_param_into_net``.
    filter_prefix : str or tuple of str, optional
        Skip the entries whose names start with it (e.g. ``"moments."``).

    A file written with ``integrated_save=False`` holds one rank's slices: its sharded
    entries are those slices (``param.slice_layout`` is ``(TensorLayout, rank)``).
    """
    owner = "load_checkpoint"
    path = _check_path(owner, ckpt_file_name)
    if filter_prefix is not None:
        prefixes = (filter_prefix,) if isinstance(filter_prefix, str) else filter_prefix
        if not isinstance(prefixes, (tuple, list)) or \
                not all(isinstance(x, str) for x in prefixes):
            raise TypeError(f"{owner}: filter_prefix must be a str or a tuple of str, got "
                            f"{filter_prefix!r}")
        prefixes = tuple(prefixes)
    else:
        prefixes = ()
    out = OrderedDict()
    with CheckpointFile(path) as f:
        meta = f.meta
        layouts = meta.get("layouts", {})
        # (with pipeline stages the slices are of the stage's devices: its rank there)
        rank = meta.get("stage_rank", meta.get("rank")) if meta.get("kind") == "slice" \
            else None
        for name in f.names:
            if prefixes and name.startswith(prefixes):
                continue
            p = _wrap(f.read(name), name)
            if rank is not None and name in layouts:
                lay = layout_from_dict(layouts[name], f"checkpoint file {path!r}, parameter "
                                                      f"{name!r}")
                p.__dict__["slice_layout"] = (lay, int(rank))
            out[name] = p
    if net is not None:
        load_param_into_net(net, out, strict_load=strict_load)
    return out


def _source_array(name, src, owner):
    if isinstance(src, TensorBase):
        return np.asarray(src._value())
    if isinstance(src, (np.ndarray, numbers.Number)) and not isinstance(src, bool):
        return np.asarray(src)
    raise TypeError(f"{owner}: parameter_dict[{name!r}] is a {type(src).__name__}; expected a "
                    f"Parameter, Tensor or numpy array")


def _prepare(name, target, src, owner):
    """The new storage of `target` from `src` (checked): (data, layout, extra)."""
    arr = _source_array(name, src, owner)
    if isinstance(target, StepCounter):
        if arr.shape != () or arr.dtype.kind not in "iu":
            raise ValueError(f"{owner}: {name!r} must be an integer scalar (the optimizer's "
                             f"step), got shape {arr.shape} dtype {arr.dtype}")
        return int(arr), None
    want_shape, want_dtype = tuple(target.shape), np.dtype(target.dtype)
    lay = target._layout
    sliced = getattr(src, "__dict__", {}).get("slice_layout")
    if arr.dtype != want_dtype:
        raise TypeError(f"{owner}: parameter {name!r} has dtype {arr.dtype} in the checkpoint "
                        f"but {want_dtype} in the network")
    if sliced is not None:
        return _prepare_slice(name, target, arr, sliced, owner)
    if _is_device_local(target):
        n = lay.device_matrix[0]
        if arr.shape != (n,) + want_shape:
            raise ValueError(f"{owner}: parameter {name!r} is layerwise_parallel with shape "
                             f"{want_shape} on {n} devices; the checkpoint holds shape "
                             f"{arr.shape}, expected the per-device stack {(n,) + want_shape}")
        return np.array(arr[_local_ranks(n)]), lay
    if arr.shape != want_shape:
        raise ValueError(f"{owner}: parameter {name!r} has shape {arr.shape} in the checkpoint "
                         f"but {want_shape} in the network")
    if isinstance(lay, TensorLayout):
        return lay.local_blocks_of(arr, _local_ranks(lay.device_num)), lay
    return np.array(arr, order="C"), None


def _prepare_slice(name, target, arr, sliced, owner):
    lay, rank = sliced
    b = live_backend()
    mine = tuple(b.local_ranks) if b is not None else (0,)
    if tuple(target.shape) != tuple(lay.shape):
        raise ValueError(f"{owner}: parameter {name!r} has global shape {lay.shape} in the "
                         f"checkpoint but {tuple(target.shape)} in the network")
    if mine != (rank,) or b.world_size != lay.device_num:
        raise ValueError(f"{owner}: parameter {name!r} in the checkpoint is rank {rank}'s slice "
                         f"of {lay.device_num} devices, but this process holds ranks "
                         f"{list(mine)}; load sliced checkpoints with "
                         f"load_distributed_checkpoint(network, [files of every rank])")
    cur = target._layout
    if cur is not None and cur != lay:
        raise ValueError(f"{owner}: parameter {name!r} was saved in layout {lay!r} but the "
                         f"network stores it as {cur!r}; use load_distributed_checkpoint to "
                         f"load it into another layout")
    want = lay.local_shape_of(rank)
    if arr.shape != want:
        raise ValueError(f"{owner}: parameter {name!r}: the slice has shape {arr.shape}, its "
                         f"layout gives {want}")
    if not lay.even:                   # a piece of unequal size: its padded slot
        slot = np.zeros((1,) + tuple(lay.local_shape), arr.dtype)
        slot[(0,) + tuple(slice(0, m) for m in want)] = arr
        return slot, lay
    return np.array(arr[None]), lay


def load_param_into_net(net, parameter_dict, strict_load=False):
    """Load `parameter_dict` (from ``load_checkpoint``) into the parameters of `net`.

    Parameters
    ----------
    net : Cell
        A network, an optimizer (its states and step are restored), or a cell holding
        both.
    parameter_dict : dict {name: Parameter | Tensor | numpy array}
    strict_load : bool
        True: every parameter of `net` must be in `parameter_dict` and every entry of
        `parameter_dict` must name a parameter of `net`.

    Returns
    -------
    list of str
        The names of `net`'s parameters that were not loaded.

    Every value is checked (name, shape, dtype) and the new storage of every parameter
    built before any parameter changes; a sharded parameter gets only its local shards.
    """
    owner = "load_param_into_net"
    if not isinstance(net, Cell):
        raise TypeError(f"{owner}: net must be a dualmode.nn.Cell, got {type(net).__name__}")
    if not isinstance(parameter_dict, dict):
        raise TypeError(f"{owner}: parameter_dict must be a dict {{name: Parameter}} (from "
                        f"load_checkpoint), got {type(parameter_dict).__name__}")
    if not isinstance(strict_load, bool):
        raise TypeError(f"{owner}: strict_load must be a bool, got {strict_load!r}")
    targets = checkpoint_entries(net, owner)
    if strict_load:
        unknown = [k for k in parameter_dict if k not in targets]
        if unknown:
            raise ValueError(f"{owner}: strict_load=True and the checkpoint has parameter(s) "
                             f"{unknown} that the network does not have; its parameters are "
                             f"{list(targets)}")
        missing = [k for k in targets if k not in parameter_dict]
        if missing:
            raise ValueError(f"{owner}: strict_load=True and the network's parameter(s) "
                             f"{missing} are not in the checkpoint")
    staged, not_loaded = [], []
    for name, target in targets.items():
        if name not in parameter_dict:
            not_loaded.append(name)
            continue
        if not isinstance(target, (Parameter, StepCounter)):
            continue
        staged.append((target, _prepare(name, target, parameter_dict[name], owner)))
    for target, new in staged:              # nothing can fail from here on
        _swap(target, new)
    return not_loaded


def _swap(target, new):
    if isinstance(target, StepCounter):
        target.optimizer.global_step = new[0]
        return
    data, lay = new
    target._data = data
    target._init = None
    if lay is not None and target._layout is None:
        target.__dict__["_sharded_by"] = "load_checkpoint"
    target._layout = lay

