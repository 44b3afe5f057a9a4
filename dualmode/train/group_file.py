"""The group file (``group_ckpt_save_file``): the communication groups of the
collectives this process ran since the key was set, as JSON::

    {"format": "dualmode-groups", "version": 1,
     "groups": {"2-<hash>": [0, 1], "4-<hash>": [0, 2, 4, 6], ...}}

A group is named by its size and a hash of its ranks (as MindSpore names its groups);
groups of one device (no communication) are left out. Every collective's groups are
offered here (:data:`dualmode.communication.trace.GROUP_SINKS`, eager and compiled runs
alike); the file is rewritten atomically when a new group appears, so it always lists
every group used so far.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from .. import context
from ..communication import trace
from .safetensors_io import CheckpointError, atomic_write_bytes

__all__ = ["load_group_file", "group_name"]

FORMAT = "dualmode-groups"

_STATE = {"path": None, "seen": set(), "groups": {}}


def group_name(ranks) -> str:
    """The name of the group of `ranks` in the group file: ``"<size>-<hash>"``."""
    text = ",".join(str(int(r)) for r in ranks)
    return f"{len(ranks)}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _note(members) -> None:
    path = context._STATE.auto_parallel.group_ckpt_save_file
    if path is None:                   # the key was unset: stop listening
        if _note in trace.GROUP_SINKS:
            trace.GROUP_SINKS.remove(_note)
        return
    path = os.fspath(path)
    if _STATE["path"] != path:
        _STATE.update(path=path, seen=set(), groups={})
    m = np.asarray(members)
    key = (m.shape, m.tobytes())
    if key in _STATE["seen"]:
        return
    _STATE["seen"].add(key)
    groups, new = _STATE["groups"], False
    for row in m.reshape(-1, m.shape[-1]).tolist():
        if len(row) > 1:
            name = group_name(row)
            if name not in groups:
                groups[name] = row
                new = True
    if new:
        doc = {"format": FORMAT, "version": 1, "groups": groups}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)   # as MindSpore
        atomic_write_bytes(path, json.dumps(doc, indent=1, sort_keys=True).encode())


def _follow_context(new) -> None:
    """Listen to the collectives while ``group_ckpt_save_file`` is set; a new path
    starts a new file."""
    if new.group_ckpt_save_file is None:
        return
    if new.group_ckpt_save_file != _STATE["path"]:
        _STATE.update(path=None, seen=set(), groups={})
    if _note not in trace.GROUP_SINKS:
        trace.GROUP_SINKS.append(_note)


def load_group_file(path) -> dict:
    """``{group name: [ranks]}`` from a group file (errors name the file)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_group_file: group file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"load_group_file: {path!r} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            not isinstance(doc.get("groups"), dict):
        raise CheckpointError(f"load_group_file: {path!r} is not a dualmode group file "
                              f"(expected a JSON object with format {FORMAT!r} and 'groups')")
    return {name: list(ranks) for name, ranks in doc["groups"].items()}


context._AUTO_PARALLEL_HOOKS.append(_follow_context)
