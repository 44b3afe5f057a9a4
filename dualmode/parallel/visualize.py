"""``dm.parallel.visualize``: which device holds which slice, as a table and a picture.

    visualize(x)                                    # a Tensor: its layout and shape
    visualize(Layout((2, 4), ("dp", "mp"))("dp", "None"), shape=(8, 8))
    visualize(t.layout, path="layout.png")          # also a PNG (2-D or 3-D tensors)

The table (plain text, any tensor rank) has one row per device: its rank, its
coordinates on the named device axes, the index range it holds along every dim, and a
note when the block is a **replica** of a lower rank's (repeated calculation: the
layout does not split over some device axes) or the stored values are **partial sums**
pending a reduction over some axes. The PNG draws the tensor's blocks coloured by the
first device holding each, the holders' ranks written in the block; a block held by
several devices is hatched ``//`` (replicas) or ``xx`` with a ``Σ`` (partial sums, whose
holders' values add up to the block). A 3-D tensor is drawn as one panel per block
along dim 0. The PNG needs matplotlib (``pip install dualmode[plot]``), imported only
when a path is given, so the table works without it.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

from .._core._tensor import TensorBase
from .device_local import DeviceLocalLayout
from .devices import device_num as _device_num
from .layout_spec import LayoutSpec
from .tensor_layout import TensorLayout, uneven_notes

__all__ = ["visualize", "layout_rows"]


def _resolve(obj, shape, func="visualize"):
    """The TensorLayout (or DeviceLocalLayout) to show."""
    if isinstance(obj, TensorBase):
        if shape is not None and tuple(shape) != tuple(obj.shape):
            raise ValueError(f"{func}: shape={tuple(shape)} but the tensor has shape "
                             f"{tuple(obj.shape)}; leave shape out for a tensor")
        lay = obj._layout
        if lay is None:
            return TensorLayout.replicated(tuple(obj.shape), (_device_num(),))
        return lay
    if isinstance(obj, (TensorLayout, DeviceLocalLayout)):
        if shape is not None and tuple(shape) != tuple(obj.shape):
            raise ValueError(f"{func}: shape={tuple(shape)} but the layout is of shape "
                             f"{tuple(obj.shape)}; leave shape out for a bound layout")
        return obj
    if isinstance(obj, LayoutSpec):
        if shape is None:
            raise ValueError(f"{func}: a Layout spec {obj!r} needs shape=... (the global "
                             f"shape of the tensor it lays out)")
        return obj.bind(tuple(shape))
    raise TypeError(f"{func}: tensor_or_layout is a {type(obj).__name__}; expected a "
                    f"Tensor, a TensorLayout, or a Layout spec such as "
                    f"Layout((2, 4), ('dp', 'mp'))('dp', 'None') with shape=...")


def layout_rows(layout) -> list:
    """One dict per rank: ``rank``, ``coords``, ``slices`` (per dim ``(start, stop)``),
    ``replica_of`` (the lowest rank holding the same block, or None) and ``partial``."""
    if isinstance(layout, DeviceLocalLayout):
        full = tuple((0, s) for s in layout.shape)
        return [{"rank": r, "coords": (r,), "slices": full, "replica_of": None,
                 "partial": False, "own": True} for r in range(layout.device_num)]
    blocks = layout.block_index
    _, first = np.unique(blocks, axis=0, return_index=True)
    _, inverse = np.unique(blocks, axis=0, return_inverse=True)
    owner = first[np.asarray(inverse).reshape(-1)]
    coords = layout.rank_coords
    rows = []
    for r, sl in enumerate(layout.device_slices()):
        rows.append({"rank": r, "coords": tuple(int(c) for c in coords[r]),
                     "slices": tuple((s.start, s.stop) for s in sl),
                     "replica_of": None if owner[r] == r else int(owner[r]),
                     "partial": bool(layout.partial), "own": False})
    return rows


def _axis_names(layout) -> Sequence[str]:
    if isinstance(layout, DeviceLocalLayout):
        return ("device",)
    return [layout.axis_name(a) for a in range(len(layout.device_matrix))]


def _table(layout) -> str:
    rows = layout_rows(layout)
    names = _axis_names(layout)
    ndim = len(layout.shape)
    head = [f"{layout!r}"]
    if isinstance(layout, DeviceLocalLayout):
        head.append("per-device values: every device holds its own tensor of shape "
                    f"{tuple(layout.shape)} (no global view)")
    else:
        if layout.partial:
            axes = ", ".join(layout.axis_name(a) for a in layout.partial)
            head.append(f"partial sums: the devices along ({axes}) hold summands of each "
                        f"block")
        head += uneven_notes(layout)
    cols = ["rank", "coords"] + [f"dim {d}" for d in range(ndim)] + ["note"]
    body = []
    for row in rows:
        coord = ", ".join(f"{n}={c}" for n, c in zip(names, row["coords"]))
        dims = [f"{a}:{b}" for a, b in row["slices"]]
        notes = []
        if row["own"]:
            notes.append("its own value")
        if row["replica_of"] is not None:
            notes.append(("summand, with rank " if row["partial"] else "replica of rank ")
                         + str(row["replica_of"]))
        elif row["partial"]:
            notes.append("summand")
        body.append([str(row["rank"]), coord] + dims + ["; ".join(notes)])
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
    out = head + [line, "-" * len(line)]
    out += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(out)


def visualize(tensor_or_layout, shape: Optional[Sequence[int]] = None,
              path: Optional[str] = None, file=None) -> str:
    """Print the device-to-slice table of a tensor or layout, and draw it as a PNG.

    Parameters
    ----------
    tensor_or_layout : Tensor, TensorLayout or Layout spec
        A Tensor shows its own layout (a plain value: every device holds all of it).
    shape : sequence of int, optional
        The global shape, needed for a Layout spec (``layout("dp", "None")``).
    path : str, optional
        Also write a PNG there (2-D and 3-D tensors; 1-D drawn as one row).
    file : writable text stream, optional
        Where the table goes (default: standard output).

    Returns
    -------
    str
        The table that was printed.

    Raises
    ------
    TypeError
        An object that is neither a Tensor nor a layout.
    ValueError
        A missing or mismatched shape; a PNG asked for a tensor of rank 0 or above 3 or
        for per-device values (the message says so; the table is not printed then).
    RuntimeError
        A PNG asked for without matplotlib installed.
    """
    layout = _resolve(tensor_or_layout, shape)
    text = _table(layout)
    if path is not None:
        _check_drawable(layout)
    print(text, file=sys.stdout if file is None else file)
    if path is not None:
        _draw(layout, str(path))
    return text


def _check_drawable(layout) -> None:
    if isinstance(layout, DeviceLocalLayout):
        raise ValueError("visualize: per-device values (DeviceLocalLayout) have no global "
                         "tensor to draw; the table lists what each device holds (leave "
                         "path out)")
    nd = len(layout.shape)
    if not 1 <= nd <= 3:
        raise ValueError(f"visualize: path= draws tensors of rank 1, 2 or 3; this one has "
                         f"rank {nd} (shape {tuple(layout.shape)}); leave path out for the "
                         f"table, which shows any rank")


def _draw(layout, path: str) -> None:
    try:   # optional dependency, imported only for the picture (module docstring)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        raise RuntimeError("visualize: writing a PNG needs matplotlib; install it with "
                           "pip install 'dualmode[plot]' (or leave path out for the "
                           "table)") from None
    rows = layout_rows(layout)
    shape = tuple(layout.shape)
    if len(shape) == 1:
        shape3, rows3 = (1, 1) + shape, [((0, 1), (0, 1)) + r["slices"] for r in rows]
    elif len(shape) == 2:
        shape3, rows3 = (1,) + shape, [((0, 1),) + r["slices"] for r in rows]
    else:
        shape3, rows3 = shape, [r["slices"] for r in rows]
    panels = sorted({s[0] for s in rows3})
    fig = Figure(figsize=(min(4.0 * len(panels), 16.0), 4.0))
    FigureCanvasAgg(fig)
    colours = _colours(len(rows))
    for k, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        blocks = {}
        for row, sl in zip(rows, rows3):
            if sl[0] == panel:
                blocks.setdefault(sl[1:], []).append(row["rank"])
        for (rs, cs), ranks in blocks.items():
            hatch = ("xx" if layout.partial else "//") if len(ranks) > 1 else None
            ax.add_patch(Rectangle((cs[0], rs[0]), cs[1] - cs[0], rs[1] - rs[0],
                                   facecolor=colours[ranks[0]], edgecolor="black",
                                   hatch=hatch, linewidth=1.0))
            label = ",".join(str(r) for r in ranks)
            if layout.partial and len(ranks) > 1:
                label = "Σ " + label
            ax.text((cs[0] + cs[1]) / 2, (rs[0] + rs[1]) / 2, label, ha="center",
                    va="center", fontsize=8,
                    bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0})
        ax.set_xlim(0, shape3[2])
        ax.set_ylim(shape3[1], 0)
        ax.set_aspect("auto")
        ax.set_xlabel(f"dim {len(shape) - 1}")
        if len(shape) >= 2:
            ax.set_ylabel(f"dim {len(shape) - 2}")
        if len(shape) == 3:
            ax.set_title(f"dim 0: {panel[0]}:{panel[1]}", fontsize=9)
    fig.suptitle(repr(layout), fontsize=8)
    fig.savefig(path, format="png", dpi=100)


def _colours(n: int) -> list:
    """n distinct RGB colours (a fixed hue wheel; no colormap registry needed)."""
    hues = np.arange(n) / max(n, 1)
    # HSV -> RGB with s = 0.45, v = 0.95, vectorised over the hues
    s, v = 0.45, 0.95
    i = np.floor(hues * 6).astype(int) % 6
    f = hues * 6 - np.floor(hues * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    table = np.stack([np.stack([np.full(n, v), t, np.full(n, p)], 1),
                      np.stack([q, np.full(n, v), np.full(n, p)], 1),
                      np.stack([np.full(n, p), np.full(n, v), t], 1),
                      np.stack([np.full(n, p), q, np.full(n, v)], 1),
                      np.stack([t, np.full(n, p), np.full(n, v)], 1),
                      np.stack([np.full(n, v), np.full(n, p), q], 1)])
    rgb = table[i, np.arange(n)]
    return [tuple(float(c) for c in row) for row in rgb]
