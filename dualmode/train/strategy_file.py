"""Parameter layouts as data: the strategy file and the layout dicts of ``Model.infer_*``.

A layout is written in MindSpore's terms: ``device_matrix`` (axis 0 the highest, ranks
row-major) and ``tensor_map`` with one entry per tensor dim counting device axes *from
the last (fastest) axis*: ``-1`` for a dim that is not split, an int for one axis, a
list (outer split first) for merged axes. So ``Layout((2, 4), ("dp", "mp"))("dp", "mp")``
is ``device_matrix=[2, 4], tensor_map=[1, 0]``, and strategy ``(2, 4)`` of a weight on
8 devices is the same.

The strategy file (``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``, and the
``strategy.json`` written beside sliced checkpoints) is JSON::

    {"format": "dualmode-strategy", "version": 1,
     "parameters": {"w1": {"device_matrix": [2, 4], "tensor_map": [1, 0],
                           "shape": [16, 32], "slice_shape": [8, 8], "dtype": "float32"}}}

A parameter stored whole on every device (not sharded) has ``device_matrix=[n]`` and
every tensor map entry ``-1``.

The context keys: :func:`record_layouts` is the one writer of ``strategy_ckpt_save_file``
— every place where parameters' layouts become fixed (an eager sharded op storing a
parameter, a compile, ``Model``) reports them, and the file is rewritten (atomically)
with everything this process has fixed since the key was set. :func:`context_layout`
reads ``strategy_ckpt_load_file`` for those same places (the file is read again when it
changes on disk). Both are installed into the parallel layer
(:mod:`dualmode.parallel.strategy_ckpt`).
"""
from __future__ import annotations

import json
import numbers
import os
from typing import Dict, Optional

import numpy as np

from .. import context
from ..parallel import strategy_ckpt
from ..parallel.devices import device_num
from ..parallel.strategy import is_sharded_layout
from ..parallel.tensor_layout import LayoutError, TensorLayout
from ..tensor import live_parameters
from .safetensors_io import CheckpointError, atomic_write_bytes

__all__ = ["layout_to_dict", "layout_from_dict", "layout_entry", "layout_from_entry",
           "save_strategy_file", "load_strategy_file", "parameter_layout", "record_layouts",
           "context_layout"]

FORMAT = "dualmode-strategy"


def _ms_tensor_map(lay: TensorLayout) -> list:
    n = len(lay.device_matrix)
    out = []
    for axes in lay.tensor_map:
        rev = [n - 1 - a for a in axes]
        out.append(-1 if not rev else rev[0] if len(rev) == 1 else rev)
    return out


def _axes_from_ms(entry, n, owner):
    given = entry
    if isinstance(entry, bool):
        entry = None
    if isinstance(entry, numbers.Integral):
        if entry == -1:
            return ()
        entry = [entry]
    # in a list, -1 adds no split (MindSpore's Layout writes ("mp", "None") as [i, -1])
    if not isinstance(entry, (list, tuple)) or not all(
            isinstance(e, numbers.Integral) and not isinstance(e, bool) and -1 <= e < n
            for e in entry):
        raise ValueError(f"{owner}: tensor_map entry {given!r} is not valid; each entry is "
                         f"-1 (not split), a device axis 0..{n - 1} counted from the last "
                         f"axis, or a list of them (-1 in a list adds no split)")
    return tuple(n - 1 - int(e) for e in entry if e != -1)


def parameter_layout(param, device_num: int) -> TensorLayout:
    """The TensorLayout a parameter is stored in (replicated over `device_num` when it
    is not sharded)."""
    lay = param._layout
    if isinstance(lay, TensorLayout):
        return lay
    return TensorLayout.replicated(tuple(param.shape), max(int(device_num), 1))


def layout_to_dict(lay: TensorLayout, dtype=None) -> dict:
    """The strategy-file entry of a layout."""
    out = {"device_matrix": list(lay.device_matrix), "tensor_map": _ms_tensor_map(lay),
           "shape": list(lay.shape), "slice_shape": list(lay.local_shape)}
    if dtype is not None:
        out["dtype"] = str(np.dtype(dtype))
    return out


def layout_from_dict(d, owner="strategy file", shape=None) -> TensorLayout:
    """A TensorLayout from a strategy-file entry (its ``shape``, or `shape` when given)."""
    if not isinstance(d, dict) or "device_matrix" not in d or "tensor_map" not in d:
        raise ValueError(f"{owner}: an entry needs 'device_matrix' and 'tensor_map', got "
                         f"{d!r}")
    dm = d["device_matrix"]
    if not isinstance(dm, (list, tuple)) or not dm:
        raise ValueError(f"{owner}: device_matrix={dm!r} must be a non-empty list of ints")
    shape = d.get("shape") if shape is None else shape
    if shape is None:
        raise ValueError(f"{owner}: the entry has no 'shape' (the parameter's global shape)")
    tmap = d["tensor_map"]
    if not isinstance(tmap, (list, tuple)) or len(tmap) != len(shape):
        raise ValueError(f"{owner}: tensor_map={tmap!r} needs one entry per dim of shape "
                         f"{list(shape)}")
    axes = tuple(_axes_from_ms(e, len(dm), owner) for e in tmap)
    try:
        return TensorLayout._checked(tuple(dm), axes, tuple(shape), owner=owner)
    except LayoutError as e:
        raise ValueError(str(e)) from None


def layout_entry(lay: TensorLayout) -> list:
    """A layout as ``Model.infer_*_layout`` gives it (MindSpore's form):
    ``[device_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group]``."""
    return [list(lay.device_matrix), _ms_tensor_map(lay), list(lay.local_shape), 0, True, ""]


def layout_from_entry(entry, shape, owner) -> TensorLayout:
    """A TensorLayout from an ``infer_*_layout`` entry (or a strategy-file dict) for a
    tensor of global `shape`."""
    if isinstance(entry, TensorLayout):
        if tuple(entry.shape) != tuple(shape):
            raise ValueError(f"{owner}: the layout is for shape {entry.shape}, the parameter "
                             f"has shape {tuple(shape)}")
        return entry
    if isinstance(entry, dict):
        return layout_from_dict(entry, owner, shape=shape)
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        raise ValueError(f"{owner}: a layout is [device_matrix, tensor_map, ...] (as "
                         f"Model.infer_predict_layout returns), got {entry!r}")
    lay = layout_from_dict({"device_matrix": entry[0], "tensor_map": entry[1]}, owner, shape)
    if len(entry) > 2 and entry[2] is not None and list(entry[2]) != list(lay.local_shape):
        raise ValueError(f"{owner}: slice_shape {list(entry[2])} does not match the layout "
                         f"(device_matrix {list(lay.device_matrix)}, tensor_map "
                         f"{list(entry[1])}) of shape {list(shape)}: it gives "
                         f"{list(lay.local_shape)}")
    return lay


def save_strategy_file(path: str, layouts: Dict[str, TensorLayout], dtypes=None) -> None:
    """Write `layouts` {parameter name: TensorLayout} as a strategy file, atomically."""
    dtypes = dtypes or {}
    doc = {"format": FORMAT, "version": 1,
           "parameters": {name: layout_to_dict(lay, dtypes.get(name))
                          for name, lay in layouts.items()}}
    atomic_write_bytes(os.fspath(path), json.dumps(doc, indent=1, sort_keys=True).encode())


def load_strategy_file(path, owner="strategy file") -> Dict[str, TensorLayout]:
    """{parameter name: TensorLayout} from a strategy file (errors name the file)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{owner}: strategy file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{owner}: strategy file {path!r} is not valid JSON ({e})") \
            from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            not isinstance(doc.get("parameters"), dict):
        raise CheckpointError(f"{owner}: {path!r} is not a dualmode strategy file (expected "
                              f"a JSON object with format {FORMAT!r} and 'parameters')")
    out = {}
    for name, d in doc["parameters"].items():
        out[name] = layout_from_dict(d, f"{owner} {path!r}, parameter {name!r}")
    return out


def strategy_layouts(source: Optional[object], owner: str) -> Optional[Dict[str, TensorLayout]]:
    """Layouts from a strategy file path or a ready dict; None stays None."""
    if source is None:
        return None
    if isinstance(source, dict):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        return load_strategy_file(source, owner)
    raise TypeError(f"{owner}: a strategy must be a strategy file path or a dict of "
                    f"layouts, got {type(source).__name__}")


# ---------------------------------------------------------------------------------
# the context keys
# ---------------------------------------------------------------------------------
# what this process has fixed for the current strategy_ckpt_save_file: {name: entry}
_SAVED = {"path": None, "entries": {}, "written": False}
# the parsed strategy_ckpt_load_file and the version on disk it was parsed from
_LOADED = {"key": None, "layouts": None}


def _restart_saving(new) -> None:
    """Setting ``strategy_ckpt_save_file`` to another path starts a new file."""
    if new.strategy_ckpt_save_file != context._STATE.auto_parallel.strategy_ckpt_save_file \
            or new.strategy_ckpt_save_file != _SAVED["path"]:
        _SAVED.update(path=new.strategy_ckpt_save_file, entries={}, written=False)


def record_layouts(layouts, dtypes=None) -> Optional[str]:
    """Write parameters' fixed layouts to ``strategy_ckpt_save_file`` (when set):
    `layouts` is ``{name: TensorLayout}`` or ``[(Parameter, TensorLayout), ...]``.
    The file holds everything this process has fixed since the key was set (a later
    layout of the same name replaces the earlier one); it is rewritten atomically, only
    when something changed. Every process writes the same content (layouts are global),
    each through its own temporary file renamed over the path, so ranks sharing a path
    never leave it torn."""
    path = context._STATE.auto_parallel.strategy_ckpt_save_file
    if path is None:
        return None
    if _SAVED["path"] != path:
        _SAVED.update(path=path, entries={}, written=False)
    entries = _SAVED["entries"]
    changed = not _SAVED["written"]
    items = layouts.items() if isinstance(layouts, dict) else \
        [(p.name, lay) for p, lay in layouts]
    if context._STATE.auto_parallel.strategy_ckpt_only_trainable_params:
        frozen = _frozen_names(layouts)
        items = [(name, lay) for name, lay in items if name not in frozen]
    dtypes = dict(dtypes or {})
    if not isinstance(layouts, dict):
        dtypes.update({p.name: p.dtype for p, _ in layouts})
    for name, lay in items:
        if not isinstance(lay, TensorLayout):
            continue
        entry = layout_to_dict(lay, dtypes.get(name))
        if entries.get(name) != entry:
            entries[name] = entry
            changed = True
    if changed:
        doc = {"format": FORMAT, "version": 1, "parameters": entries}
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)   # as MindSpore
        atomic_write_bytes(path, json.dumps(doc, indent=1, sort_keys=True).encode())
        _SAVED["written"] = True
    return path


def _frozen_names(layouts) -> set:
    """The names in `layouts` of parameters that are not trainable (``requires_grad``
    False): given as Parameters, or named in a dict and every live Parameter of that
    name frozen."""
    if not isinstance(layouts, dict):
        return {p.name for p, _ in layouts if not p.requires_grad}
    live = {}
    for p in live_parameters():
        live.setdefault(p.name, []).append(p.requires_grad)
    return {name for name in layouts if name in live and not any(live[name])}


def _loaded_layouts(path, owner) -> Dict[str, TensorLayout]:
    """The layouts of the strategy file at `path`, parsed once per version on disk."""
    try:
        st = os.stat(path)
        key = (path, st.st_ino, st.st_mtime_ns, st.st_size)   # atomic writes: new inode
    except OSError:
        key = None                      # load_strategy_file names the missing file
    if key is None or _LOADED["key"] != key:
        layouts = load_strategy_file(path, owner)
        _LOADED.update(key=key, layouts=layouts)
    return _LOADED["layouts"]


def context_layout(param, owner) -> Optional[TensorLayout]:
    """`param`'s layout from ``strategy_ckpt_load_file`` (None: the key is not set, or
    the file does not name the parameter or stores it whole). A layout for another
    shape or device count is an error naming the file and the parameter."""
    cfg = context._STATE.auto_parallel
    path = cfg.strategy_ckpt_load_file
    if path is None or (cfg.strategy_ckpt_only_trainable_params and not param.requires_grad):
        return None
    path = os.fspath(path)
    lay = _loaded_layouts(path, f"{owner}: strategy_ckpt_load_file").get(param.name)
    if lay is None or not is_sharded_layout(lay):
        return None
    n = device_num()
    if tuple(lay.shape) != tuple(param.shape) or lay.device_num != n:
        raise ValueError(f"{owner}: strategy_ckpt_load_file {path!r} lays parameter "
                         f"{param.name!r} out as {lay!r} (shape {lay.shape}, "
                         f"{lay.device_num} devices) but it has shape {tuple(param.shape)} "
                         f"and {n} devices are running")
    return lay


strategy_ckpt.install(record_layouts, context_layout)
context._AUTO_PARALLEL_HOOKS.append(_restart_saving)
