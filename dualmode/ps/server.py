"""A server: holds shards of the server-held weights and runs the optimizer on them.

Workers talk to it through a ROUTER socket on its data address; the scheduler through
a DEALER (heartbeats, ``worker_lost`` / ``worker_done``, ``shutdown``). One thread,
one loop: requests are handled in arrival order, so a pull always sees a whole
step.

A **group** is the set of shards one optimizer of the workers owns on this server
(``"opt0"``, ...); each group has a **version**, the number of steps applied. Requests:

``init``       the group's shards (names, shapes, optimizer spec) with the worker's
               initial values; the first worker's values are kept, and a worker whose
               values differ is refused (seed every worker alike). A table the servers
               initialise comes with its initializer instead, and its rows are made
               here (:func:`_initial_values`). Answer: the values (not those of such a
               table).
``push``       one step's gradients (dense arrays; for a sparse table the ids used
               since the last push, their rows, and the ids the worker keeps cached).
               sync: the step is applied when every live worker has pushed it, with
               the mean of their gradients; async: at once (a gradient more than
               ``staleness`` versions old is dropped). Answer, once applied: the new
               values (for a sparse table: the worker's cached rows that changed since
               this server last answered it).
``pull_rows``  rows of a sparse table by id.
``pull``       one shard whole (a worker reads a weight whose copy there is stale).

No copies on the way: a push's arrays are views of the received frames, and the answer
sends the shards' own buffers. A group of dense shards has the header of its answers
encoded once (:class:`.transport.Template`: per answer only the version and the request
id are formatted in), and a worker's pushes to it, once its first was decoded, are read
without parsing (``Template.match`` against that worker's push header; any other
message is decoded). The shards that share an optimizer spec share one
optimizer (one call per step updates them all). Plain SGD and Momentum run fused
(:func:`.optim.fused_step`): the workers' gradients are summed in worker order,
averaged and applied in one pass whose result is written into the first worker's
received gradient buffer, which becomes the shard's storage; the old storage, possibly
still being sent, is never written again, so these replies are not tracked. Any other
optimizer updates its shards in place, after the gradients are summed into the first
worker's buffer; its replies are tracked until ZeroMQ has sent them, and a shard still
being sent when the next update comes (a slow or lost worker, an async push) is given a
copy to update instead.

With DM_RECOVERY_PATH set, the shards, optimizer states and versions are written to
``<path>/server_<id>.safetensors`` (atomically) after every ``recovery_interval``
applied steps; a server restarted by hand loads it and goes on from there.

A sparse table's step is the dense one: the workers push only the rows they used, and
the server applies its optimizer to the whole shard with zero gradients elsewhere
(Momentum, Adam and weight decay also move rows a step did not use, as on one device),
except for plain SGD (:func:`.optim.row_local`), whose step on the used rows alone is
the same. Each row remembers the version that last changed it, and each worker the
version of its last answer, so an answer carries the cached rows that are out of date
on that worker, in sync and async mode alike.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import zmq
from safetensors import safe_open
from safetensors.numpy import save as st_save

from .. import context
from ..common.initializer import described
from ..tensor import Parameter, Tensor
from .env import ClusterEnv
from .optim import (build_optimizer, fusable, fused_step, optimizer_meta, restore_optimizer,
                    row_local, state_arrays, swap_rows, unswap_rows)
from .scheduler import log
from .transport import (_DTYPE_OF, PSError, Template, answer_template, decode, local_host,
                        push_template, recv, recv_frames, send, send_encoded, send_tracked)

__all__ = ["run_server", "checkpoint_path"]

#: the longest the server waits for a request before it looks at the scheduler's
#: messages and its heartbeats (milliseconds)
_WAIT_MS = 100


def checkpoint_path(root: str, server_id: int) -> str:
    """The recovery file of server `server_id` under `root`."""
    return os.path.join(root, f"server_{server_id}.safetensors")


@dataclass
class _Key:
    spec: Dict[str, Any]
    param: Parameter
    opt: Any                          # the optimizer updating this shard
    slot: int                         # the shard's index in opt.parameters
    fused: bool = False               # updated by fused_step (never in place)
    #: a sparse table: the version that last changed each row of the shard
    row_version: Optional[np.ndarray] = None
    #: a sparse table whose optimizer's step runs on the used rows alone (row_local)
    row_local: bool = False
    sending: list = field(default_factory=list)      # trackers of replies of param._data

    @property
    def sparse(self) -> bool:
        return bool(self.spec.get("sparse"))


@dataclass
class _Group:
    gid: str
    keys: List[_Key]
    opts: List[Tuple[Any, List[int]]]   # each optimizer, with the indices of its keys
    version: int = 0
    pending: Dict[int, Dict[int, List[np.ndarray]]] = field(default_factory=dict)
    #: step -> the pushes to answer once it is applied: (identity, header, the ids
    #: each sparse shard's pusher keeps cached)
    owed: Dict[int, List[Tuple[bytes, dict, list]]] = field(default_factory=dict)
    since_checkpoint: int = 0
    dropped: int = 0
    #: the header of the answers to pushes, encoded once (dense shards only), else None
    answer_template: Optional[Template] = None
    #: every shard is updated fused (its answers are not tracked)
    all_fused: bool = False
    #: worker -> the version of this group's last answer to it (sparse tables' rows
    #: changed after it are out of date in that worker's cache)
    answered: Dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        dense = not any(k.sparse for k in self.keys)
        self.all_fused = dense and all(k.fused for k in self.keys)
        if dense and all(k.spec["dtype"] in _DTYPE_OF for k in self.keys):
            self.answer_template = answer_template(self.specs())

    def specs(self) -> List[Tuple[str, List[int]]]:
        """(dtype name, shape) of each shard, as the workers' init described them."""
        return [(k.spec["dtype"], k.spec["shape"]) for k in self.keys]


def _public_spec(spec: Dict[str, Any]) -> Dict[str, Any]:
    return {k: spec.get(k) for k in ("name", "shape", "dtype", "rows", "sparse", "init")}


def _initial_values(specs: List[Dict[str, Any]], arrays: List[np.ndarray]) -> list:
    """The initial value of each shard of an ``init``: the array the worker sent, or,
    for a table the servers initialise (``set_param_ps(init_in_server=True)``), its rows
    made here from the table's initializer (the values the whole table has on one
    device, bit for bit)."""
    if len(arrays) != len(specs):
        raise PSError(f"init: {len(arrays)} arrays for {len(specs)} shard(s)")
    out = []
    for spec, a in zip(specs, arrays):
        desc = spec.get("init")
        if desc is None:
            out.append(a)
            continue
        table = tuple(desc["table_shape"])
        starts = np.zeros((1, len(table)), np.int64)
        starts[0, 0] = spec["rows"][0]
        out.append(described(desc).blocks(table, spec["dtype"], starts,
                                          tuple(spec["shape"]))[0])
    return out


def _make_keys(specs: List[Dict[str, Any]], values: List[np.ndarray]):
    """The shards `specs` with their initial `values`, and their optimizers: the dense
    shards that share an optimizer spec share one optimizer (one call per step updates
    them all); a sparse table has its own."""
    params = [Parameter(Tensor._from_array(np.array(v, dtype=spec["dtype"])), name=spec["name"])
              for spec, v in zip(specs, values)]
    buckets: Dict[Any, List[int]] = {}
    for k, spec in enumerate(specs):
        tag = ("sparse", k) if spec.get("sparse") else json.dumps(spec["opt"], sort_keys=True)
        buckets.setdefault(tag, []).append(k)
    keys: List[Optional[_Key]] = [None] * len(specs)
    opts = []
    for idx in buckets.values():
        opt = build_optimizer(specs[idx[0]]["opt"], [params[k] for k in idx])
        opts.append((opt, idx))
        sparse = bool(specs[idx[0]].get("sparse"))
        fused = not sparse and fusable(opt)
        for slot, k in enumerate(idx):
            keys[k] = _Key(specs[k], params[k], opt, slot, fused)
            if sparse:
                keys[k].row_version = np.zeros(params[k].shape[0], np.int64)
                keys[k].row_local = row_local(opt)
    return keys, opts


def split_push(g: _Group, arrays: List[np.ndarray], where: str) -> list:
    """The pushed arrays per key (a sparse key: its ids, their rows and the ids the
    worker keeps cached), checked against the shards' shapes before anything changes
    (PSError naming the shard)."""
    need = sum(3 if key.sparse else 1 for key in g.keys)
    if need != len(arrays):
        raise PSError(f"{where}: {len(arrays)} arrays for {len(g.keys)} shard(s) of "
                      f"{g.gid}; expected {need}")
    out, i = [], 0
    for key in g.keys:
        shape = key.param._data.shape
        if key.sparse:
            ids, rows, cached = arrays[i:i + 3]
            if ids.ndim != 1 or rows.shape != ids.shape + shape[1:]:
                raise PSError(f"{where}: the rows of {key.spec['name']!r} have shape "
                              f"{rows.shape} for {ids.shape} ids; expected rows of "
                              f"shape {shape[1:]}")
            _check_ids(where, key, "ids", ids)
            _check_ids(where, key, "cached ids", cached)
            out.append((ids, rows, cached))
            i += 3
        else:
            if arrays[i].shape != shape:
                raise PSError(f"{where}: the gradient of {key.spec['name']!r} has shape "
                              f"{arrays[i].shape}; the shard has shape {shape}")
            out.append(arrays[i])
            i += 1
    return out


def _check_ids(where: str, key: _Key, what: str, ids: np.ndarray) -> None:
    """PSError unless `ids` is a 1-D integer array of rows of `key`'s shard."""
    lo, hi = key.spec["rows"]
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or \
            (len(ids) and (ids.min() < lo or ids.max() >= hi)):
        raise PSError(f"{where}: the {what} of {key.spec['name']!r} must be a 1-D array of "
                      f"integers in this server's rows [{lo}, {hi}), got {ids.dtype} "
                      f"{ids.shape} in [{ids.min() if ids.size else '-'}, "
                      f"{ids.max() if ids.size else '-'}]")


def make_writable(key: _Key) -> None:
    """Let the optimizer write `key`'s shard: a shard ZeroMQ is still sending to a
    worker (sent without a copy) is replaced by a copy first."""
    if key.sending:
        if not all(t.done for t in key.sending):
            key.param._data = key.param._data.copy()
        key.sending = []


class _Server:
    def __init__(self, env: ClusterEnv, cfg: context.PSConfig):
        self.env, self.cfg = env, cfg
        self.ctx = zmq.Context.instance()
        self.sched = self.ctx.socket(zmq.DEALER)
        self.sched.setsockopt(zmq.LINGER, 500)
        self.sched.connect(env.sched_address)
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 500)
        self.groups: Dict[str, _Group] = {}
        self.live: set = set(range(env.worker_num))
        self.id = -1
        self.address = None
        self.push_bytes = self.pull_bytes = 0
        #: a worker's identity -> the headers of its pushes of dense groups seen so far
        #: (template, group, worker): read without parsing
        self.pushes: Dict[bytes, List[Tuple[Template, str, int]]] = {}

    # ------------------------------------------------------------ joining
    def join(self) -> None:
        env, cfg = self.env, self.cfg
        host = env.node_host or local_host(env.sched_host)
        port = self.data.bind_to_random_port("tcp://*")
        self.address = f"tcp://{host}:{port}"
        send(self.sched, {"op": "register", "role": "server", "address": self.address,
                          "pid": os.getpid(), "server_num": env.server_num,
                          "worker_num": env.worker_num, "mode": cfg.mode,
                          "staleness": cfg.staleness})
        head = self._await_scheduler()
        self.id = head["id"]
        if "bind" in head and head["bind"] != self.address:
            # a restarted server listens where the one it replaces did
            self.data.unbind(f"tcp://0.0.0.0:{port}")
            bind = head["bind"]
            try:
                self.data.bind("tcp://*:" + bind.rsplit(":", 1)[1])
            except zmq.ZMQError as exc:
                raise RuntimeError(f"init: restarted server {self.id} cannot listen on "
                                   f"{bind} again ({exc}); the port is in use") from None
            self.address = bind
            self.recover()
        log("server", f"server {self.id} of {env.server_num} serving on {self.address}")

    def _await_scheduler(self) -> dict:
        cfg, env = self.cfg, self.env
        end = time.monotonic() + cfg.connect_timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"init: the scheduler at DM_SCHED_HOST:DM_SCHED_PORT="
                                   f"{env.sched_host}:{env.sched_port} did not form the "
                                   f"cluster within connect_timeout={cfg.connect_timeout:g} "
                                   "s (is it running, and do all roles use that address?)")
            if self.sched.poll(int(min(left, 1.0) * 1000)):
                head, _ = recv(self.sched, "scheduler")
                if head.get("op") == "error":
                    raise RuntimeError("init: the scheduler refused this server: "
                                       + head["message"])
                if head.get("op") == "cluster":
                    return head

    # ---------------------------------------------------------- recovery
    def checkpoint(self) -> None:
        root = self.env.recovery_path
        if root is None:
            return
        tensors, meta = {}, {}
        for gid, g in self.groups.items():
            keys = []
            for k, key in enumerate(g.keys):
                tensors[f"{gid}/{k}/value"] = key.param._data
                for name, arr in state_arrays(key.opt, key.slot).items():
                    tensors[f"{gid}/{k}/state/{name}"] = arr
                keys.append({"spec": key.spec, "opt": optimizer_meta(key.opt, key.slot)})
            meta[gid] = {"version": g.version, "keys": keys}
        os.makedirs(root, exist_ok=True)
        path = checkpoint_path(root, self.id)
        tmp = path + f".tmp{os.getpid()}"
        blob = st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                       metadata={"dualmode_ps": json.dumps(meta)})
        with open(tmp, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def recover(self) -> None:
        root = self.env.recovery_path
        path = checkpoint_path(root, self.id) if root else None
        if path is None or not os.path.exists(path):
            log("server", f"server {self.id} restarted without a recovery checkpoint "
                f"(DM_RECOVERY_PATH={root!r}); workers that used it will fail")
            return
        with safe_open(path, "np") as fh:
            meta = json.loads(fh.metadata()["dualmode_ps"])
            arrays = {k: fh.get_tensor(k) for k in fh.keys()}
        for gid, gm in meta.items():
            keys, opts = _make_keys([km["spec"] for km in gm["keys"]],
                                    [arrays[f"{gid}/{k}/value"] for k in range(len(gm["keys"]))])
            for k, (key, km) in enumerate(zip(keys, gm["keys"])):
                states = {name.rsplit("/", 1)[1]: arr for name, arr in arrays.items()
                          if name.startswith(f"{gid}/{k}/state/")}
                restore_optimizer(key.opt, key.slot, km["opt"], states)
            self.groups[gid] = _Group(gid, keys, opts, version=gm["version"])
        log("server", f"server {self.id} resumed from {path}: " + ", ".join(
            f"{gid} at step {g.version}" for gid, g in self.groups.items()))

    # ------------------------------------------------------------ requests
    def on_init(self, ident: bytes, head: dict, arrays: List[np.ndarray]) -> None:
        gid, worker, specs = head["group"], head["worker"], head["keys"]
        g = self.groups.get(gid)
        if g is None:
            if head.get("step", 0) > 0:
                return self.error(ident, head, f"server {self.id} has no state for {gid} "
                                  f"at step {head['step']}: it was restarted without a "
                                  "recovery checkpoint (set DM_RECOVERY_PATH on the servers "
                                  "to resume after a server fails)")
            keys, opts = _make_keys(specs, _initial_values(specs, arrays))
            g = self.groups[gid] = _Group(gid, keys, opts)
            log("server", f"{gid}: {len(keys)} shard(s) from worker {worker}: " + ", ".join(
                f"{k.spec['name']}{tuple(k.spec['shape'])}"
                + (" (initialised here)" if "init" in k.spec else "") for k in keys))
            self.checkpoint()
        else:
            mine = [_public_spec(k.spec) for k in g.keys]
            theirs = [_public_spec(s) for s in specs]
            if mine != theirs:
                return self.error(ident, head, f"worker {worker} describes {gid} as "
                                  f"{theirs}, but server {self.id} holds {mine}; every "
                                  "worker must build the same network and optimizer")
            if g.version == 0:
                for k, a in zip(g.keys, arrays):
                    if "init" not in k.spec and not np.array_equal(k.param._data, a):
                        return self.error(ident, head, f"worker {worker}'s initial value "
                                          f"of parameter {k.spec['name']!r} differs from "
                                          "the first worker's; seed every worker alike "
                                          "(dm.set_seed) before building the network")
        # the values of the shards the worker sent (a server-initialised table's are
        # not sent: the worker keeps only the rows it uses)
        made = ["init" in k.spec for k in g.keys]
        self.reply(ident, head, {"op": "init_ok", "version": g.version},
                   [k.param._data[:0].reshape(-1) if m else k.param._data
                    for k, m in zip(g.keys, made)],
                   [None if k.fused or m else k for k, m in zip(g.keys, made)])

    def on_push(self, ident: bytes, head: dict, arrays: List[np.ndarray]) -> None:
        gid, worker, step = head["group"], head["worker"], head["step"]
        g = self.groups.get(gid)
        if g is None:
            return self.error(ident, head, f"server {self.id} has no state for {gid}: it "
                              "was restarted without a recovery checkpoint (set "
                              "DM_RECOVERY_PATH on the servers to resume after a failure)")
        self.push_bytes += sum(a.nbytes for a in arrays)
        grads = split_push(g, arrays, f"push from worker {worker}")
        if g.answer_template is not None:
            # this worker's next pushes of this group are read without parsing
            seen = self.pushes.setdefault(ident, [])
            if all(t[1] != gid for t in seen):
                seen.append((push_template(gid, worker, g.specs()), gid, worker))
        cached = [t[2] if key.sparse else None for key, t in zip(g.keys, grads)]
        if self.cfg.mode == "async":
            if self.cfg.staleness is not None and g.version - head["base"] > self.cfg.staleness:
                g.dropped += 1
                log("server", f"{gid}: dropped a gradient of worker {worker} computed on "
                    f"step {head['base']} (now {g.version}; staleness={self.cfg.staleness})")
            else:
                self.apply(g, [grads], mean=False)
            return self.answer(ident, head, g, cached)
        if step < g.version:              # pushed again after a restart: already applied
            return self.answer(ident, head, g, cached)
        if step > g.version:
            return self.reply(ident, head, {"op": "replay", "version": g.version})
        g.pending.setdefault(step, {})[worker] = grads
        g.owed.setdefault(step, []).append((ident, head, cached))
        self.maybe_apply(g)

    def maybe_apply(self, g: _Group) -> None:
        step = g.version
        got = g.pending.get(step, {})
        if not got or not self.live.issubset(got):
            return
        self.apply(g, [got[w] for w in sorted(got)], mean=True)
        g.pending.pop(step, None)
        for ident, head, cached in g.owed.pop(step, []):
            self.answer(ident, head, g, cached)

    def apply(self, g: _Group, pushes: list, mean: bool) -> None:
        """One step of `g`'s optimizers with the sum (`mean`: the mean) of `pushes`
        (each the split arrays of one push, in worker order): fused (see the module
        docstring), or in place with the gradients summed into the first push's
        received buffer (one optimizer call for all its shards; a shard still being
        sent to a worker is first given a copy to update)."""
        n = len(pushes)
        for opt, idx in g.opts:
            first = g.keys[idx[0]]
            if first.fused:
                fused_step(opt, [(g.keys[k].param, g.keys[k].slot, [p[k] for p in pushes])
                                 for k in idx], mean)
            elif first.sparse:
                make_writable(first)
                ids = np.concatenate([p[idx[0]][0] for p in pushes])
                rows = np.concatenate([p[idx[0]][1] for p in pushes])
                uniq, inv = np.unique(ids, return_inverse=True)
                grad = np.zeros((len(uniq),) + rows.shape[1:], rows.dtype)
                np.add.at(grad, inv, rows)
                if mean and n > 1:
                    grad /= n
                local = uniq - first.spec["rows"][0]
                if first.row_local:
                    # the step on the used rows alone is the dense step
                    saved = swap_rows(opt, first.slot, local)
                    try:
                        opt((Tensor._from_array(grad),))
                    finally:
                        unswap_rows(saved, local)
                    first.row_version[local] = g.version + 1
                else:
                    # the dense step: zero gradients in the rows no worker used
                    dense = np.zeros(first.param.shape, first.param.dtype)
                    dense[local] = grad
                    opt((Tensor._from_array(dense),))
                    first.row_version[:] = g.version + 1
            else:
                grads = []
                for k in idx:
                    key = g.keys[k]
                    make_writable(key)
                    grad = np.asarray(pushes[0][k], key.param._data.dtype)
                    if n > 1:
                        if not grad.flags.writeable:
                            grad = grad.copy()
                        for p in pushes[1:]:
                            np.add(grad, p[k], out=grad)
                        if mean:
                            np.divide(grad, n, out=grad)
                    grads.append(Tensor._from_array(grad))
                opt(tuple(grads))
        g.version += 1
        g.since_checkpoint += 1
        if g.since_checkpoint >= self.cfg.recovery_interval:
            self.checkpoint()
            g.since_checkpoint = 0

    def answer(self, ident: bytes, head: dict, g: _Group, cached: list) -> None:
        """The new values after a push: every dense shard, and of each sparse one the
        rows among the pusher's `cached` ids (per key; None for a dense one) that
        changed since this group last answered that worker."""
        req = head.get("req")
        if g.all_fused and g.answer_template is not None and type(req) is int:
            # the shards' new buffers, never written again: sent as they are
            arrays = [key.param._data for key in g.keys]
            send_encoded(self.data, g.answer_template(g.version, req), arrays, ident)
            self.pull_bytes += g.answer_template.nbytes
            return
        arrays, sent = [], []
        since = g.answered.get(head["worker"], -1)
        for k, key in enumerate(g.keys):
            if key.sparse:
                local = cached[k] - key.spec["rows"][0]
                local = local[key.row_version[local] > since]
                arrays += [local + key.spec["rows"][0], key.param._data[local]]
                sent += [None, None]
            else:
                arrays.append(key.param._data)
                sent.append(None if key.fused else key)
        self.reply(ident, head, {"op": "pulled", "version": g.version}, arrays, sent)
        g.answered[head["worker"]] = g.version

    def on_pull_rows(self, ident: bytes, head: dict, arrays: List[np.ndarray]) -> None:
        g = self.groups.get(head["group"])
        if g is None:
            return self.error(ident, head, f"server {self.id} has no state for "
                              f"{head['group']}")
        key = g.keys[head["key"]]
        ids = arrays[0]
        self.reply(ident, head, {"op": "rows", "version": g.version},
                   [key.param._data[ids - key.spec["rows"][0]]])

    def on_pull(self, ident: bytes, head: dict, arrays: List[np.ndarray]) -> None:
        """A worker reads shard `key` whole (a read of a weight whose copy there is
        stale): a copy, since the optimizer may write the shard while it is sent."""
        g = self.groups.get(head["group"])
        if g is None:
            return self.error(ident, head, f"server {self.id} has no state for "
                              f"{head['group']}")
        key = g.keys[head["key"]]
        self.reply(ident, head, {"op": "value", "version": g.version},
                   [np.array(key.param._data)])

    def reply(self, ident: bytes, req: dict, head: dict, arrays=(), keys=None) -> None:
        """Answer request `req`; `keys` (aligned with `arrays`): the key whose shard an
        array is, when the optimizer writes that shard in place (sent without a copy:
        tracked until ZeroMQ is done with it), or None."""
        head["req"] = req.get("req")
        track = [k is not None for k in keys] if keys is not None else False
        nbytes, trackers = send_tracked(self.data, head, arrays, ident, track)
        self.pull_bytes += nbytes
        if keys is not None:
            for key, tracker in zip(keys, trackers):
                if key is not None and tracker is not None:
                    key.sending.append(tracker)

    def error(self, ident: bytes, req: dict, message: str) -> None:
        log("server", "refused a request: " + message)
        self.reply(ident, req, {"op": "error", "message": message})

    # ------------------------------------------------------------------ loop
    def on_scheduler(self, head: dict) -> Optional[int]:
        op = head.get("op")
        if op in ("worker_lost", "worker_done"):
            w = head["worker"]
            self.live.discard(w)
            why = "lost" if op == "worker_lost" else "finished"
            if op == "worker_lost":
                log("server", f"worker {w} {why}; sync steps go on with the live workers "
                    f"{sorted(self.live)}")
            for g in self.groups.values():
                self.maybe_apply(g)
        elif op == "shutdown":
            for g in self.groups.values():
                if g.since_checkpoint:
                    self.checkpoint()
                    break
            log("server", f"server {self.id} stopping: " + ", ".join(
                f"{gid} at step {g.version}" + (f" ({g.dropped} stale gradients dropped)"
                                                if g.dropped else "")
                for gid, g in self.groups.items()))
            send(self.sched, {"op": "bye"})
            return 0
        return None

    def serve(self) -> int:
        cfg = self.cfg
        data, sched = self.data, self.sched
        # a receive waits at most this long, then the scheduler's messages and the
        # heartbeats are looked at (also after every request)
        data.setsockopt(zmq.RCVTIMEO, _WAIT_MS)
        last_ack = last_hb = time.monotonic()
        handlers = {"init": self.on_init, "push": self.on_push, "pull_rows": self.on_pull_rows,
                    "pull": self.on_pull}
        where = f"server {self.id}"
        while True:
            try:
                frames = recv_frames(data)
            except zmq.Again:
                frames = None
            if frames is not None:
                ident = frames[0].bytes
                head = None
                for template, gid, worker in self.pushes.get(ident, ()):
                    matched = template.match(frames[1:])
                    if matched is not None:
                        (step, base, req), arrays = matched
                        head = {"op": "push", "group": gid, "worker": worker, "step": step,
                                "base": base, "req": req}
                        break
                if head is None:
                    head, arrays = decode(frames[1:], where)
                handler = handlers.get(head.get("op"))
                if handler is None:
                    self.error(ident, head, f"unknown request op={head.get('op')!r}")
                else:
                    try:
                        handler(ident, head, arrays)
                    except (PSError, ValueError, TypeError, KeyError) as exc:
                        self.error(ident, head, f"{type(exc).__name__}: {exc}")
            # ask before receiving: a zmq.Again costs more than this (an exception
            # object built in Python)
            while sched.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                head, _ = recv(sched, "scheduler", flags=zmq.NOBLOCK)
                last_ack = time.monotonic()
                status = self.on_scheduler(head)
                if status is not None:
                    return status
            now = time.monotonic()
            if now - last_hb >= cfg.heartbeat_interval:
                send(sched, {"op": "hb"})
                last_hb = now
            if now - last_ack > cfg.heartbeat_timeout:
                log("server", f"server {self.id}: the scheduler at {self.env.sched_host}:"
                    f"{self.env.sched_port} is lost (no answer for "
                    f"{now - last_ack:.1f} s); ending the job")
                return 1


def run_server(env: ClusterEnv, cfg: context.PSConfig) -> int:
    """Join the cluster and serve until the scheduler says the workers are done; the
    exit status."""
    server = _Server(env, cfg)
    try:
        server.join()
        return server.serve()
    finally:
        server.data.close()
        server.sched.close()
