"""Sliced checkpoints under another strategy or device count: ``merge_sliced_checkpoints``,
``transform_checkpoints`` (offline) and ``load_distributed_checkpoint`` (into a network).

Every function works from the per-rank files written by
``save_checkpoint(..., integrated_save=False)`` and the layouts they were saved under
(the strategy file, or the layouts recorded in each file's header). A box of a
parameter's global value is read from the distinct source blocks it overlaps (one
replica each), and from each only the byte range spanning the overlap
(``CheckpointFile.read_region``): a device that needs a quarter of a weight reads about
a quarter of it. ``load_distributed_checkpoint`` fills the new stack of local shards in
place: each distinct block among this process's devices is read into its device's slot
(a source block that is the whole slot straight from the file, with no intermediate
array), then copied to the devices that hold replicas of it in one numpy call.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..nn.cell import Cell
from ..parallel.devices import live_backend
from ..parallel.tensor_layout import TensorLayout
from .safetensors_io import CheckpointError, CheckpointFile, open_all, write_file
from .serialization import STEP_NAME, StepCounter, _swap, checkpoint_entries, sliced_path
from .strategy_file import (layout_from_dict, layout_from_entry, layout_to_dict,
                            save_strategy_file, strategy_layouts)

__all__ = ["merge_sliced_checkpoints", "transform_checkpoints", "load_distributed_checkpoint",
           "SlicedCheckpoint"]


def _whole(shape):
    return tuple(slice(0, n) for n in shape)


class SlicedCheckpoint:
    """The per-rank files of one sliced checkpoint, opened and checked together.

    Parameters
    ----------
    filenames : list of str
        One file per rank, in rank order.
    strategy : str (strategy file) or dict {name: TensorLayout}, optional
        The layouts the slices were saved under; default: those in the files' headers.
    owner : str
        The function name used in error messages.
    """

    def __init__(self, filenames: Sequence[str], strategy=None, owner="checkpoint"):
        if isinstance(filenames, (str, os.PathLike)) or not isinstance(filenames, (list, tuple)) \
                or not filenames:
            raise TypeError(f"{owner}: checkpoint_filenames must be a non-empty list of file "
                            f"paths (one per rank, in rank order), got {filenames!r}")
        for i, p in enumerate(filenames):
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"{owner}: checkpoint_filenames[{i}]={p!r} is not a path")
        self.owner = owner
        self.paths = [os.fspath(p) for p in filenames]
        given = strategy_layouts(strategy, owner)
        self.files: List[CheckpointFile] = list(open_all(self.paths).values())
        try:
            self._check(given)
        except BaseException:
            self.close()
            raise

    def _check(self, given):
        first = self.files[0]
        self.meta = first.meta
        integrated = self.meta.get("kind") == "integrated"
        if integrated and len(self.files) > 1:
            raise CheckpointError(f"{self.owner}: {self.paths[0]!r} is an integrated checkpoint "
                                  f"(global values); pass it alone, not with other files")
        n = len(self.files)
        # pipeline stages: stage s's files (ranks s * per ..) hold its entries, sliced over
        # its per devices; without stages every file holds every entry, sliced over n
        stages = 1 if integrated else self.meta.get("stages", 1)
        if n % stages:
            raise CheckpointError(f"{self.owner}: {first.path!r} is a slice of a run of "
                                  f"{stages} pipeline stages, but {n} files were given; give "
                                  f"one file per rank of every stage, in rank order")
        per = n // stages
        for r, f in enumerate(self.files):
            kind, rank = f.meta.get("kind"), f.meta.get("rank")
            if not integrated and (kind != "slice" or rank != r):
                raise CheckpointError(
                    f"{self.owner}: checkpoint_filenames[{r}]={f.path!r} holds "
                    f"{'the slices of rank ' + str(rank) if kind == 'slice' else 'no slices'}; "
                    f"give one sliced file per rank, in rank order")
            if stages > 1 and (f.meta.get("stages") != stages or f.meta.get("stage") != r // per):
                raise CheckpointError(
                    f"{self.owner}: checkpoint_filenames[{r}]={f.path!r} holds pipeline stage "
                    f"{f.meta.get('stage')} of {f.meta.get('stages')}; the files of a run of "
                    f"{stages} stages go in rank order (stage {r // per} at position {r})")
            group = self.files[r - r % per]
            if set(f.names) != set(group.names):
                diff = sorted(set(f.names) ^ set(group.names))
                raise CheckpointError(f"{self.owner}: {f.path!r} and {group.path!r} hold "
                                      f"different parameters ({diff})")
        #: name -> the files holding it, in the rank order of its layout (its stage's)
        self._sources: Dict[str, List[CheckpointFile]] = {}
        for s in range(stages):
            group = self.files[s * per:(s + 1) * per]
            for name in group[0].names:
                self._sources.setdefault(name, group)
        self._names = list(self._sources)
        recorded = {}
        if not integrated:
            for name, group in self._sources.items():
                d = group[0].meta.get("layouts", {}).get(name)
                if d is not None:
                    recorded[name] = layout_from_dict(d, f"checkpoint file {group[0].path!r}, "
                                                         f"parameter {name!r}")
        layouts = dict(recorded) if given is None else {k: v for k, v in given.items()
                                                         if k in self._sources}
        self.layouts: Dict[str, Optional[TensorLayout]] = {}
        for name, group in self._sources.items():
            lay = layouts.get(name)
            if lay is not None and lay.device_num != len(group):
                raise CheckpointError(f"{self.owner}: parameter {name!r} was sliced over "
                                      f"{lay.device_num} devices (strategy) but "
                                      f"{len(group)} files were given; give one file per rank")
            for r, f in enumerate(group):
                # (a split that does not divide: each rank its own piece's shape)
                want = lay.local_shape_of(r) if lay is not None else None
                got = f.shape(name)
                if want is not None and got != want:
                    raise CheckpointError(f"{self.owner}: checkpoint file {f.path!r}, parameter "
                                          f"{name!r}: slice shape {got} does not match its "
                                          f"strategy {lay!r} (slice shape {want})")
            self.layouts[name] = lay

    @property
    def names(self):
        return self._names

    def global_shape(self, name):
        lay = self.layouts[name]
        return tuple(lay.shape) if lay is not None else self._sources[name][0].shape(name)

    def dtype(self, name):
        return self._sources[name][0].dtype(name)

    def read(self, name, box=None) -> np.ndarray:
        """``global_value[box]`` of `name` (a new array) from the distinct source blocks
        it overlaps."""
        shape = self.global_shape(name)
        box = _whole(shape) if box is None else tuple(box)
        out = np.empty(tuple(s.stop - s.start for s in box), self.dtype(name))
        return self.read_into(name, box, out)

    def read_into(self, name, box, out: np.ndarray) -> np.ndarray:
        """Fill `out` (an array of the box's shape, e.g. one device's slot of a stack) with
        ``global_value[box]`` of `name`: from each distinct source block it overlaps, only
        the bytes spanning the overlap; a source block that is all of `out` is read
        straight into it (no copy)."""
        shape = self.global_shape(name)
        box = tuple(box)
        lay = self.layouts[name]
        files = self._sources[name]
        if lay is None:
            return files[0].read_region(name, box, out)
        lo = np.array([s.start for s in box], np.int64)
        hi = np.array([s.stop for s in box], np.int64)
        blocks, ranks = np.unique(lay.block_index, axis=0, return_index=True)
        starts = lay.part_starts[ranks]                 # each block's real extent
        b_lo = np.maximum(starts, lo)
        b_hi = np.minimum(starts + lay.local_shapes[ranks], hi)
        hit = np.all(b_hi > b_lo, axis=1) if len(shape) else np.ones(len(ranks), bool)
        for r, s, a, z in zip(ranks[hit], starts[hit], b_lo[hit], b_hi[hit]):   # one per file
            src = tuple(slice(int(x - o), int(y - o)) for x, y, o in zip(a, z, s))
            dst = tuple(slice(int(x - o), int(y - o)) for x, y, o in zip(a, z, lo))
            files[int(r)].read_region(name, src, out[dst])
        return out

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    def close(self):
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: the header keys that describe one rank's file (its rank, its stage, its layouts)
_PER_FILE = ("rank", "layouts", "stage", "stage_rank", "stages")


# ---------------------------------------------------------------------------------
def merge_sliced_checkpoints(checkpoint_filenames, strategy_file, output_path):
    """Rebuild the global values from per-rank slice files into one integrated file.

    Parameters
    ----------
    checkpoint_filenames : list of str
        One file per rank, in rank order (``<dir>/rank_<r>/<name>``).
    strategy_file : str or None
        The strategy the slices were saved under (None: the layouts in the files).
    output_path : str
        The integrated checkpoint to write (atomically).
    """
    owner = "merge_sliced_checkpoints"
    if not isinstance(output_path, (str, os.PathLike)):
        raise TypeError(f"{owner}: output_path must be a file path, got {output_path!r}")
    with SlicedCheckpoint(checkpoint_filenames, strategy_file, owner) as src:
        tensors = [(name, src.read(name)) for name in src.names]
        meta = {k: v for k, v in src.meta.items() if k not in _PER_FILE}
        meta.update(kind="integrated",
                    layouts={k: layout_to_dict(v) for k, v in src.layouts.items()
                             if v is not None})
    write_file(os.fspath(output_path), tensors, meta)


_RANK_DIR = re.compile(r"^rank_(\d+)$")


def _rank_dirs(owner, src_dir):
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"{owner}: src_dir {src_dir!r} does not exist")
    ranks = sorted(int(m.group(1)) for m in map(_RANK_DIR.match, os.listdir(src_dir)) if m)
    if not ranks:
        raise CheckpointError(f"{owner}: src_dir {src_dir!r} has no rank_<r> directories (as "
                              f"save_checkpoint(..., integrated_save=False) writes)")
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointError(f"{owner}: src_dir {src_dir!r} lacks rank directories "
                              f"{['rank_%d' % r for r in missing]}")
    return len(ranks)


def _device_num_of(owner, layouts, what):
    counts = {lay.device_num for lay in layouts.values()}
    if len(counts) != 1:
        raise ValueError(f"{owner}: {what} lays parameters over different device counts "
                         f"{sorted(counts)}; a strategy is for one device count")
    return counts.pop()


def transform_checkpoints(src_dir, dst_dir, src_strategy_file=None, dst_strategy_file=None):
    """Re-slice every checkpoint in `src_dir` (``rank_<r>/<name>``, one directory per
    source rank) for the layouts of `dst_strategy_file`, writing ``dst_dir/rank_<r>/<name>``
    and ``dst_dir/strategy.json``; with no `dst_strategy_file`, write the integrated
    (global) checkpoints ``dst_dir/<name>``. Parameters the destination strategy does
    not list are stored whole on every rank. Offline: no devices are needed."""
    owner = "transform_checkpoints"
    for what, v in (("src_dir", src_dir), ("dst_dir", dst_dir)):
        if not isinstance(v, (str, os.PathLike)):
            raise TypeError(f"{owner}: {what} must be a directory path, got {v!r}")
    src_dir, dst_dir = os.fspath(src_dir), os.fspath(dst_dir)
    n_src = _rank_dirs(owner, src_dir)
    dst_layouts = strategy_layouts(dst_strategy_file, owner)
    if dst_layouts is not None and not dst_layouts:
        raise ValueError(f"{owner}: dst_strategy_file {dst_strategy_file!r} lists no "
                         f"parameters; omit it to write integrated checkpoints")
    n_dst = _device_num_of(owner, dst_layouts, "dst_strategy_file") if dst_layouts else None
    names = sorted(f for f in os.listdir(os.path.join(src_dir, "rank_0"))
                   if os.path.isfile(os.path.join(src_dir, "rank_0", f))
                   and not f.startswith("."))
    if not names:
        raise CheckpointError(f"{owner}: {os.path.join(src_dir, 'rank_0')!r} holds no "
                              f"checkpoint files")
    os.makedirs(dst_dir, exist_ok=True)
    for base in names:
        files = [os.path.join(src_dir, f"rank_{r}", base) for r in range(n_src)]
        if dst_layouts is None:
            merge_sliced_checkpoints(files, src_strategy_file, os.path.join(dst_dir, base))
            continue
        with SlicedCheckpoint(files, src_strategy_file, owner) as src:
            for name, lay in dst_layouts.items():
                if name in src.layouts and tuple(lay.shape) != src.global_shape(name):
                    raise ValueError(f"{owner}: dst_strategy_file gives parameter {name!r} "
                                     f"shape {lay.shape}; the checkpoint holds "
                                     f"{src.global_shape(name)}")
            meta = {k: v for k, v in src.meta.items() if k not in _PER_FILE}
            meta.update(kind="slice", device_num=n_dst,
                        layouts={k: layout_to_dict(v) for k, v in dst_layouts.items()
                                 if k in src.layouts})
            cache = {}
            for r in range(n_dst):                  # one file per destination rank
                tensors = []
                for name in src.names:
                    lay = dst_layouts.get(name)
                    box = lay.device_slices()[r] if lay is not None else None
                    key = (name, None if box is None else
                           tuple((b.start, b.stop) for b in box))
                    if key not in cache:
                        cache[key] = src.read(name, box)
                    tensors.append((name, cache[key]))
                path = sliced_path(os.path.join(dst_dir, base), r)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_file(path, tensors, dict(meta, rank=r))
    if dst_layouts is not None:
        save_strategy_file(os.path.join(dst_dir, "strategy.json"), dst_layouts)


# ---------------------------------------------------------------------------------
def _local_ranks(n):
    b = live_backend()
    if b is not None and b.world_size == n:
        return np.asarray(b.local_ranks, np.int64)
    return np.arange(n, dtype=np.int64)


def _device_count():
    b = live_backend()
    return b.world_size if b is not None else 1


def load_distributed_checkpoint(network, checkpoint_filenames, predict_strategy=None,
                                train_strategy_filename=None, strict_load=False):
    """Load slices saved under one strategy and device count into `network` running
    under another, reading only the bytes each of this process's devices needs.

    Parameters
    ----------
    network : Cell
    checkpoint_filenames : list of str
        The per-rank files of the training run, in rank order (or one integrated file).
    predict_strategy : dict {name: [device_matrix, tensor_map, ...]}, optional
        The layouts to load into (``Model.infer_predict_layout``/``infer_train_layout``);
        a parameter not listed keeps its current layout (global when it has none).
    train_strategy_filename : str, optional
        The strategy file of the training run (default: the layouts in the files).
    strict_load : bool
        As in ``load_param_into_net``.

    Returns
    -------
    list of str
        The names of `network`'s parameters that were not loaded.
    """
    owner = "load_distributed_checkpoint"
    if not isinstance(network, Cell):
        raise TypeError(f"{owner}: network must be a dualmode.nn.Cell, got "
                        f"{type(network).__name__}")
    if predict_strategy is not None and not isinstance(predict_strategy, dict):
        raise TypeError(f"{owner}: predict_strategy must be a dict {{name: layout}} (as "
                        f"Model.infer_predict_layout returns) or None, got "
                        f"{type(predict_strategy).__name__}")
    targets = checkpoint_entries(network, owner)
    n = _device_count()
    with SlicedCheckpoint(checkpoint_filenames, train_strategy_filename, owner) as src:
        known = set(src.names)
        if predict_strategy:
            unknown = [k for k in predict_strategy if k not in targets]
            if unknown:
                raise ValueError(f"{owner}: predict_strategy names {unknown}, which the "
                                 f"network does not have")
        if strict_load:
            extra = [k for k in src.names if k not in targets]
            missing = [k for k in targets if k not in known]
            if extra or missing:
                raise ValueError(f"{owner}: strict_load=True and the checkpoint's parameters "
                                 f"{extra} are not in the network / the network's "
                                 f"{missing} are not in the checkpoint")
        staged, not_loaded = [], []
        for name, target in targets.items():
            if name not in known:
                not_loaded.append(name)
                continue
            where = f"{owner}: parameter {name!r} (files {src.paths[0]!r}...)"
            if isinstance(target, StepCounter):
                v = src.read(name)
                if v.shape != () or v.dtype.kind not in "iu":
                    raise CheckpointError(f"{where}: {STEP_NAME} must be an integer scalar")
                staged.append((target, (int(v), None)))
                continue
            shape = tuple(target.shape)
            if src.global_shape(name) != shape:
                raise ValueError(f"{where}: shape {src.global_shape(name)} in the checkpoint "
                                 f"but {shape} in the network")
            if src.dtype(name) != np.dtype(target.dtype):
                raise TypeError(f"{where}: dtype {src.dtype(name)} in the checkpoint but "
                                f"{np.dtype(target.dtype)} in the network")
            lay = target._layout
            if predict_strategy and name in predict_strategy:
                lay = layout_from_entry(predict_strategy[name], shape,
                                        f"{owner}: predict_strategy[{name!r}]")
                if lay.device_num != n:
                    raise ValueError(f"{owner}: predict_strategy[{name!r}] lays the parameter "
                                     f"over {lay.device_num} devices but {n} are running")
            if lay is not None and not isinstance(lay, TensorLayout):
                raise ValueError(f"{where}: the network holds it as per-device "
                                 f"(layerwise_parallel) values; it cannot be re-sliced")
            staged.append((target, _load_one(src, name, lay)))
    for target, new in staged:              # nothing can fail from here on
        _swap(target, new)
    return not_loaded


def _load_one(src, name, lay):
    """(local stack or global value, layout) of `name` for this process's devices: each
    distinct block among them read from the files straight into its device's slot of the
    new stack, then copied to the devices holding replicas of it (one numpy call)."""
    if lay is None:
        return src.read(name), None
    if lay.partial:
        region = src.read(name)
        return lay.local_blocks_of(region, _local_ranks(lay.device_num)), lay
    ranks = _local_ranks(lay.device_num)
    blocks = lay.block_index[ranks]
    _, first, inverse = np.unique(blocks, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    # a split that does not divide: the short pieces' slots keep zeros past their rows
    stack = (np.empty if lay.even else np.zeros)((len(ranks),) + tuple(lay.local_shape),
                                                 src.dtype(name))
    for k in first:                                 # one read per distinct block
        start, size = lay.part_starts[ranks[k]], lay.local_shapes[ranks[k]]
        box = tuple(slice(int(a), int(a + m)) for a, m in zip(start, size))
        src.read_into(name, box, stack[k][tuple(slice(0, int(m)) for m in size)])
    source = first[inverse]
    dup = np.flatnonzero(source != np.arange(len(ranks)))
    if dup.size:
        stack[dup] = stack[source[dup]]
    return stack, lay
