"""The strategy file keys (``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``) as
the parallel layer sees them.

Every place where a parameter's layout becomes fixed reports it here
(:func:`layouts_fixed`): an eager sharded op storing a parameter in its layout
(``strategy._store_sharded``) and a compile planning where the parameters live
(``graph/api.py``). The same places ask here first for a parameter's saved layout
(:func:`saved_layout`). Reading and writing the file — its JSON form, the merging of
what this process fixed, atomic writes, the checks against the network — belong to the
training layer, which installs them (:mod:`dualmode.train.strategy_file`), as the layer
rule asks of behaviour a lower layer needs.
"""
from __future__ import annotations

from .. import context

__all__ = ["install", "layouts_fixed", "saved_layout", "loading"]

_IO = {"record": None, "lookup": None}


def install(record, lookup) -> None:
    """`record([(Parameter, TensorLayout), ...])` writes layouts to the save file;
    `lookup(param, owner)` gives a parameter's saved layout (or None), raising an error
    naming the file and the parameter when the file does not fit it."""
    _IO["record"] = record
    _IO["lookup"] = lookup


def _installed(what):
    fn = _IO[what]
    if fn is None:                     # dualmode/__init__ imports the training layer
        raise RuntimeError("the strategy file keys need dualmode.train imported "
                           "(import dualmode)")
    return fn


def layouts_fixed(pairs) -> None:
    """`pairs` (``[(Parameter, TensorLayout), ...]``) now have fixed layouts: written to
    ``strategy_ckpt_save_file`` when it is set."""
    if context._STATE.auto_parallel.strategy_ckpt_save_file is not None:
        _installed("record")(pairs)


def loading() -> bool:
    """Is ``strategy_ckpt_load_file`` set?"""
    return context._STATE.auto_parallel.strategy_ckpt_load_file is not None


def saved_layout(param, owner):
    """The layout ``strategy_ckpt_load_file`` gives `param` (None: the key is not set or
    the file does not name it, or stores it whole)."""
    if context._STATE.auto_parallel.strategy_ckpt_load_file is None:
        return None
    return _installed("lookup")(param, owner)
