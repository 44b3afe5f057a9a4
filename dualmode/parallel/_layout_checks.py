"""Validation of layouts and strategy tuples: small ``_check_*`` functions behind a few
entry points (``check_layout_args``, ``check_spec_entries``, ``check_tensor_layout``,
``check_strategy``), and the error classes they raise.

Every message states the rule, then what was received, prefixed by the owner (the
``Layout``, the op, or ``TensorLayout``), e.g.
``MatMul: in_strategy[0][1]=4 exceeds dim 1 (size 3) of input 0: ...``.
"""
from __future__ import annotations

import math

import numpy as np

NONE = "None"


class LayoutError(ValueError):
    """An invalid layout, tensor map or strategy."""


class IndivisibleError(LayoutError):
    """A tensor dim cannot be cut into the number of parts asked for."""


class EmptyShardError(IndivisibleError):
    """A split into more parts than the dim has rows: some device's piece would be
    empty. (A split that does not divide is allowed: numpy.array_split's pieces.)"""


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def axis_names(axes, alias, noun=True) -> str:
    """How messages name device axes: ``axis 'mp'`` / ``axes ('sp', 'dp')`` with aliases
    (bare ``'mp'`` / ``('sp', 'dp')`` when ``noun`` is false), else ``axis 1`` / ``axes (1, 0)``."""
    axes = tuple(axes)
    if alias is None:
        return f"axis {axes[0]}" if len(axes) == 1 else f"axes {axes}"
    names = tuple(alias[a] for a in axes)
    text = repr(names[0]) if len(names) == 1 else repr(names)
    return text if not noun else ("axis " if len(names) == 1 else "axes ") + text


# ---------------------------------------------------------------- Layout(device_matrix, alias)

def _check_device_matrix(owner, device_matrix):
    if not isinstance(device_matrix, (tuple, list)) or not device_matrix \
            or not all(_is_int(v) for v in device_matrix):
        raise TypeError(f"{owner}: device_matrix must be a non-empty tuple of ints, "
                        f"e.g. (2, 4); got {device_matrix!r}")
    for i, v in enumerate(device_matrix):
        if v < 1:
            raise LayoutError(f"{owner}: device_matrix[{i}]={v} must be a positive int "
                              f"(the number of devices along axis {i}); got "
                              f"device_matrix={tuple(device_matrix)}")
    return tuple(int(v) for v in device_matrix)


def _check_alias_name(owner, alias_name, device_matrix):
    if not isinstance(alias_name, (tuple, list)) or not all(isinstance(a, str) for a in alias_name):
        raise TypeError(f"{owner}: alias_name must be a tuple of strings, one per device-matrix "
                        f"axis, e.g. ('dp', 'mp'); got {alias_name!r}")
    alias_name = tuple(alias_name)
    if len(alias_name) != len(device_matrix):
        raise LayoutError(f"{owner}: alias_name {alias_name} has {len(alias_name)} names but "
                          f"device_matrix {device_matrix} has {len(device_matrix)} axes; give "
                          f"one name per axis")
    for i, a in enumerate(alias_name):
        if not a:
            raise LayoutError(f"{owner}: alias_name[{i}] is empty; aliases must be non-empty "
                              f"strings, got {alias_name}")
        if a == NONE:
            raise LayoutError(f"{owner}: alias_name[{i}]='None' is reserved (it marks an unsplit "
                              f"dim); choose another name, got {alias_name}")
        if a in alias_name[:i]:
            raise LayoutError(f"{owner}: alias {a!r} appears twice in alias_name {alias_name}; "
                              f"aliases must be distinct")
    return alias_name


def check_layout_args(device_matrix, alias_name):
    """Validate ``Layout(device_matrix, alias_name)``; return both as tuples."""
    owner = f"Layout({device_matrix!r}, {alias_name!r})"
    dm = _check_device_matrix(owner, device_matrix)
    return dm, _check_alias_name(owner, alias_name, dm)


# ---------------------------------------------------------------- layout("mp", ("sp", "dp"))

def _valid_aliases(alias_name):
    return ", ".join(repr(a) for a in alias_name) + " or 'None'"


def _check_entry(owner, dim, entry, alias_name):
    """One tensor dim's entry -> tuple of aliases (() for 'None'). In a tuple, 'None'
    adds no split (as in MindSpore, where it maps to -1): ``("sp", "None")`` is ``"sp"``
    and ``("None",)`` leaves the dim unsplit."""
    if entry is None or entry == NONE:
        return ()
    names = (entry,) if isinstance(entry, str) else entry
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{owner}: dim {dim} maps to {entry!r}; each dim takes an alias, a tuple "
                        f"of aliases or 'None' ({_valid_aliases(alias_name)})")
    if not names:
        raise LayoutError(f"{owner}: dim {dim} maps to an empty tuple; use 'None' to leave a dim "
                          f"unsplit")
    names = tuple(n for n in names if n != NONE)
    for n in names:
        if n not in alias_name:
            raise LayoutError(f"{owner}: unknown alias {n!r} for dim {dim}; valid aliases are "
                              f"{_valid_aliases(alias_name)}")
    return names


def check_spec_entries(owner, entries, alias_name):
    """Validate the arguments of ``layout(...)``; return per-dim tuples of aliases."""
    spec = tuple(_check_entry(owner, d, e, alias_name) for d, e in enumerate(entries))
    seen = {}
    for d, names in enumerate(spec):
        for n in names:
            if n in seen:
                where = f"dim {d}" if seen[n] == d else f"dims {seen[n]} and {d}"
                raise LayoutError(f"{owner}: alias {n!r} is used twice in {tuple(entries)!r} "
                                  f"({where}); each device axis may split at most one dim once")
            seen[n] = d
    return spec


# ---------------------------------------------------------------- TensorLayout fields

def _check_int_tuple(owner, name, value):
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise TypeError(f"{owner}: {name} must be a tuple of ints; got {value!r}")
    return tuple(int(v) for v in value)


def _check_shape(owner, shape):
    shape = _check_int_tuple(owner, "shape", shape)
    for d, n in enumerate(shape):
        if n < 0:
            raise LayoutError(f"{owner}: shape {shape} has negative size {n} at dim {d}")
    return shape


def _check_tensor_map(owner, tensor_map, shape, naxes, alias):
    if not isinstance(tensor_map, (tuple, list)):
        raise TypeError(f"{owner}: tensor_map must be a tuple with one tuple of device axes per "
                        f"tensor dim; got {tensor_map!r}")
    if len(tensor_map) != len(shape):
        raise LayoutError(f"{owner}: tensor_map {tuple(tensor_map)} has {len(tensor_map)} entries "
                          f"but the tensor has rank {len(shape)} (shape {shape})")
    out, used = [], {}
    for d, axes in enumerate(tensor_map):
        axes = _check_int_tuple(owner, f"tensor_map[{d}]", axes)
        for a in axes:
            if not 0 <= a < naxes:
                raise LayoutError(f"{owner}: tensor_map[{d}] names device axis {a}, but the "
                                  f"device matrix has axes 0..{naxes - 1}")
            if a in used:
                raise LayoutError(f"{owner}: {axis_names((a,), alias)} splits both dim "
                                  f"{used[a]} and dim {d}; each device axis may split at most "
                                  f"one dim once")
            used[a] = d
        out.append(axes)
    return tuple(out)


def _check_partial(owner, partial, tensor_map, naxes, alias):
    partial = _check_int_tuple(owner, "partial", partial)
    split = {a for axes in tensor_map for a in axes}
    for a in partial:
        if not 0 <= a < naxes:
            raise LayoutError(f"{owner}: partial names device axis {a}, but the device matrix "
                              f"has axes 0..{naxes - 1}")
        if a in split:
            raise LayoutError(f"{owner}: {axis_names((a,), alias)} both splits a dim and holds "
                              f"partial sums; an axis can do only one of the two")
    if len(set(partial)) != len(partial):
        raise LayoutError(f"{owner}: partial {partial} names an axis twice")
    return tuple(sorted(partial))


def _devices(k) -> str:
    return "1 device" if k == 1 else f"{k} devices"


def _check_not_empty(owner, shape, tensor_map, device_matrix, alias):
    for d, axes in enumerate(tensor_map):
        parts = math.prod(device_matrix[a] for a in axes)
        if 0 < shape[d] < parts:
            what = axis_names(axes, alias, noun=False)
            raise EmptyShardError(f"{owner}: dim {d} (size {shape[d]}) cannot be split into "
                                  f"the {parts} parts of {what}: {_devices(parts - shape[d])} "
                                  f"would hold an empty piece (shape {shape}); a split may "
                                  f"not exceed the dim (at most {shape[d]} parts)")


def _check_alias(owner, alias, naxes):
    if alias is None:
        return None
    if not isinstance(alias, (tuple, list)) or len(alias) != naxes \
            or not all(isinstance(a, str) and a for a in alias) or len(set(alias)) != len(alias):
        raise LayoutError(f"{owner}: alias must be None or {naxes} distinct non-empty strings "
                          f"(one per device axis); got {alias!r}")
    return tuple(alias)


def check_tensor_layout(device_matrix, tensor_map, shape, partial, alias, owner="TensorLayout"):
    """Validate and normalise the fields of a ``TensorLayout``."""
    dm = _check_device_matrix(owner, device_matrix)
    alias = _check_alias(owner, alias, len(dm))
    shape = _check_shape(owner, shape)
    tmap = _check_tensor_map(owner, tensor_map, shape, len(dm), alias)
    partial = _check_partial(owner, partial, tmap, len(dm), alias)
    _check_not_empty(owner, shape, tmap, dm, alias)
    return dm, tmap, shape, partial, alias


# ---------------------------------------------------------------- strategy tuples

def check_device_num(owner, device_num):
    if not _is_int(device_num) or device_num < 1:
        raise LayoutError(f"{owner}: device_num must be a positive int; got {device_num!r}")
    return int(device_num)


def check_strategy(strategy, shape, device_num, op_name="", input_index=0, param="in_strategy"):
    """Validate one input's strategy tuple against its shape and ``device_num``."""
    owner = op_name or "strategy"
    where = f"{param}[{input_index}]"
    role = "output" if param.startswith("out") else "input"
    device_num = check_device_num(owner, device_num)
    if not isinstance(strategy, (tuple, list)) or not all(_is_int(v) for v in strategy):
        raise TypeError(f"{owner}: {where}={strategy!r} must be a tuple of ints, one per dim "
                        f"of {role} {input_index}")
    strategy = tuple(int(v) for v in strategy)
    shape = _check_shape(owner, shape)
    if len(strategy) != len(shape):
        raise LayoutError(f"{owner}: {where}={strategy} has {len(strategy)} entries but "
                          f"{role} {input_index} has rank {len(shape)} (shape {shape})")
    for j, v in enumerate(strategy):
        if v < 1:
            raise LayoutError(f"{owner}: {where}[{j}]={v} must be a positive int (the number of "
                              f"parts dim {j} is split into)")
    for j, (v, n) in enumerate(zip(strategy, shape)):
        if 0 < n < v:
            raise EmptyShardError(f"{owner}: {where}[{j}]={v} exceeds dim {j} (size {n}) of "
                                  f"{role} {input_index}: {_devices(v - n)} would hold an "
                                  f"empty piece; a split may not exceed the dim (at most {n} parts)")
    total = math.prod(strategy)
    if total > device_num:
        raise LayoutError(f"{owner}: {where}={strategy} needs {total} devices but device_num is "
                          f"{device_num}; the product of a strategy must divide device_num")
    if device_num % total:
        raise LayoutError(f"{owner}: {where}={strategy} needs {total} devices, which does not "
                          f"divide device_num={device_num}; the product of a strategy must "
                          f"divide device_num")
    return strategy, shape, device_num
