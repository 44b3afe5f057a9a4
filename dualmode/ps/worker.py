"""A worker's side of parameter server mode: joining, heartbeats, push and pull.

The worker registers with the scheduler (its MPI rank as id when it runs under MPI),
gets the servers' addresses and opens one DEALER socket to each. A background thread
owns the scheduler socket: it sends heartbeats and notices when the scheduler is gone.

An optimizer call (``Optimizer.construct``) hands the gradients of its server-held
parameters to :meth:`WorkerClient.step`: the first call places the parameters over the
servers (:mod:`.placement`) and sends each server its shards and the optimizer spec
(``init``); every call sends each server one ``push`` with the gradients of its shards
and returns once every server has answered with the new values (a message per server
per step; the gradients are sent without copies, and a pulled weight held whole by one
server keeps the received frame as its storage). A push of dense shards only has its
header, and that of its answer, encoded once per session and server
(:class:`.transport.Template`: per step only the step, base version and request id
are formatted in, and the answer is read without parsing). A server that does not
answer is asked again every ``heartbeat_timeout`` seconds (a restarted server resumes
from its checkpoint and answers; with ``recovery_interval > 1`` it asks for the steps
since that checkpoint, which the worker keeps); after ``connect_timeout`` seconds
without an answer the call raises an error naming the server.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import numpy as np
import zmq

from .. import context
from .._core._tensor import TensorBase
from ..communication import trace
from ..common.initializer import describe
from ..tensor import register_read_hook
from .embedding import server_initialised
from .env import ClusterEnv
from .optim import optimizer_spec
from .placement import Shard, place
from .transport import (_DTYPE_OF, Template, answer_template, decode, push_template,
                        recv_frames, send, send_encoded)

__all__ = ["WorkerClient", "active_worker"]

#: the longest a worker waits for a server's answer before it looks at the other
#: servers, its heartbeat thread's news, resends and timeouts (milliseconds)
_WAIT_MS = 100


def active_worker() -> Optional["WorkerClient"]:
    """The live worker client of this process, or None (not a PS worker)."""
    return context._STATE.ps_role


class _Request(NamedTuple):
    """One message to a server: its header fields, its arrays, and the header encoded
    once (a push of dense shards: the integer fields step, base and req formatted in
    per message) or None (encoded from `head`); `answer`: the header of the expected
    answer (the new values of dense shards), read without parsing, or None."""

    head: dict
    arrays: list
    template: Optional[Template] = None
    answer: Optional[Template] = None


@dataclass
class _OptSession:
    """One optimizer's server-held parameters."""

    gid: str
    params: tuple                               # the optimizer's parameters
    held: Tuple[int, ...]                       # indices into optimizer.parameters
    shards: Dict[int, List[Shard]]              # server -> its shards, in key order
    #: server -> the headers of its pushes and of its answers, encoded once (None: it
    #: holds a sparse shard)
    templates: Dict[int, Optional[Tuple[Template, Template]]] = field(default_factory=dict)
    step: int = 0
    version: int = 0
    history: collections.deque = field(default_factory=collections.deque)
    #: the parameters whose copy here is stale after a step (see WorkerClient.refresh)
    stale: tuple = ()


class WorkerClient:
    """This process as worker ``rank`` of the cluster."""

    def __init__(self, env: ClusterEnv, cfg: context.PSConfig, rank: Optional[int]):
        self.env, self.cfg = env, cfg
        self.ctx = zmq.Context.instance()
        self.sched = self.ctx.socket(zmq.DEALER)
        self.sched.setsockopt(zmq.LINGER, 500)
        self.sched.connect(env.sched_address)
        self.requested_rank = rank
        self.rank = -1
        self.servers: List[str] = []
        self.socks: List[zmq.Socket] = []
        self.sessions: Dict[int, _OptSession] = {}
        self.sparse: Dict[int, Any] = {}        # id(param) -> its EmbeddingLookup cache
        self.req = itertools.count(1)
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.lost: Optional[str] = None
        self._finish = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ joining
    def join(self) -> None:
        env, cfg = self.env, self.cfg
        send(self.sched, {"op": "register", "role": "worker", "rank": self.requested_rank,
                          "pid": os.getpid(), "server_num": env.server_num,
                          "worker_num": env.worker_num, "mode": cfg.mode,
                          "staleness": cfg.staleness})
        end = time.monotonic() + cfg.connect_timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self.sched.close(linger=0)
                raise RuntimeError(
                    f"init: no answer from the scheduler at DM_SCHED_HOST:DM_SCHED_PORT="
                    f"{env.sched_host}:{env.sched_port} within connect_timeout="
                    f"{cfg.connect_timeout:g} s: it is not running there, or not all of the "
                    f"{env.server_num} server(s) (DM_SERVER_NUM) and {env.worker_num} "
                    "worker(s) (DM_WORKER_NUM) joined")
            if self.sched.poll(int(min(left, 0.5) * 1000)):
                head, _ = decode(self.sched.recv_multipart(), "scheduler")
                if head.get("op") == "error":
                    self.sched.close(linger=0)
                    raise RuntimeError("init: the scheduler refused this worker: "
                                       + head["message"])
                if head.get("op") == "cluster":
                    break
        self.rank = head["id"]
        self.servers = list(head["servers"])
        for addr in self.servers:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, _WAIT_MS)     # a wait for an answer: checks between
            s.connect(addr)
            self.socks.append(s)
        self._thread = threading.Thread(target=self._heartbeat, name="dualmode-ps-heartbeat",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.finish)

    def _heartbeat(self) -> None:
        cfg, env = self.cfg, self.env
        sock = self.sched
        last_ack = last_hb = time.monotonic()
        lost_at = None
        while True:
            if self._finish.is_set():
                if self.lost is None:
                    send(sock, {"op": "finish"})
                sock.close(linger=500)
                return
            now = time.monotonic()
            if now - last_hb >= cfg.heartbeat_interval:
                send(sock, {"op": "hb"})
                last_hb = now
            if sock.poll(100):
                head, _ = decode(sock.recv_multipart(), "scheduler")
                if head.get("op") == "hb_ack":
                    last_ack = time.monotonic()
            if lost_at is None and now - last_ack > cfg.heartbeat_timeout:
                lost_at = now
                self.lost = (f"the scheduler at {env.sched_host}:{env.sched_port} is lost (no "
                             f"answer to heartbeats for {now - last_ack:.1f} s); the job ends")
                print(f"[dualmode.ps worker] worker {self.rank}: {self.lost}", file=sys.stderr,
                      flush=True)
            if lost_at is not None and now - lost_at > cfg.heartbeat_timeout:
                # the script did not stop by itself (no PS call since): end the process
                os._exit(1)

    def finish(self) -> None:
        """Tell the scheduler this worker is done (at exit)."""
        if self._thread is None or self._finish.is_set():
            return
        self._finish.set()
        self._thread.join(timeout=2.0)
        for s in self.socks:
            s.close(linger=0)

    # ---------------------------------------------------------- requests
    def _check_alive(self) -> None:
        if self.lost is not None:
            raise RuntimeError(f"parameter server worker {self.rank}: {self.lost}")

    def request_all(self, requests: Dict[int, _Request]) -> Dict[int, Tuple[dict, list]]:
        """Send each server its request and wait for every answer (asking again every
        heartbeat_timeout; RuntimeError after connect_timeout without one)."""
        cfg = self.cfg
        pending = {}
        for k, request in requests.items():
            request.head["req"] = next(self.req)
            pending[k] = request
            self._send(k, request)
        answers: Dict[int, Tuple[dict, list]] = {}
        now = time.monotonic()
        sent_at = dict.fromkeys(pending, now)
        waited_from = now
        while pending:
            self._check_alive()
            # wait (at most _WAIT_MS) for the first server still owing an answer: every
            # answer is needed, so the others are read when it has come; when it does
            # not come, the others are looked at without waiting
            first = next(iter(pending))
            try:
                frames = recv_frames(self.socks[first])
            except zmq.Again:
                frames = None
            if frames is not None:
                if self._take_answer(first, frames, pending, answers):
                    sent_at[first] = waited_from = time.monotonic()
            else:
                for k in list(pending)[1:]:
                    sock = self.socks[k]
                    while k in pending and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        if self._take_answer(k, recv_frames(sock, zmq.NOBLOCK), pending,
                                             answers):
                            sent_at[k] = waited_from = time.monotonic()
            now = time.monotonic()
            for k in pending:
                if now - sent_at[k] > cfg.heartbeat_timeout:
                    self._send(k, pending[k])
                    sent_at[k] = now
            if pending and now - waited_from > cfg.connect_timeout:
                names = ", ".join(f"server {k} ({self.servers[k]})" for k in pending)
                raise RuntimeError(f"parameter server worker {self.rank}: no answer from "
                                   f"{names} within connect_timeout={cfg.connect_timeout:g} "
                                   "s; it is down (restart it with DM_RECOVERY_PATH set to "
                                   "resume) or another worker stalls the step")
        return answers

    def _take_answer(self, k: int, frames: list, pending: Dict[int, _Request],
                     answers: Dict[int, Tuple[dict, list]]) -> bool:
        """Handle the message `frames` from server `k`: its answer to ``pending[k]``
        moves into `answers`; the answer to an earlier resend is dropped; an error
        raises; a restarted server's request for the steps since its checkpoint is
        served. True when server `k` answered or asked (its wait starts again)."""
        request = pending[k]
        matched = request.answer.match(frames) if request.answer is not None else None
        if matched is not None:
            (version, req), arrays = matched
            if req != request.head["req"]:
                return False                   # the answer to an earlier resend
            answers[k] = ({"op": "pulled", "version": version, "req": req}, arrays)
            self.bytes_pulled += request.answer.nbytes
            del pending[k]
            return True
        head, arrays = decode(frames, f"server {k} ({self.servers[k]})")
        if head.get("req") != pending[k].head["req"]:
            return False                       # the answer to an earlier resend
        op = head.get("op")
        if op == "error":
            raise RuntimeError(f"parameter server {k} ({self.servers[k]}): "
                               + head["message"])
        if op == "replay":
            self._replay(k, pending[k], head["version"])
            return True
        answers[k] = (head, arrays)
        self.bytes_pulled += sum(a.nbytes for a in arrays)
        del pending[k]
        return True

    def _send(self, k: int, request: _Request) -> None:
        head, arrays, template, _ = request
        if template is not None:
            send_encoded(self.socks[k], template(head["step"], head["base"], head["req"]),
                         arrays)
            n = template.nbytes
        else:
            n = send(self.socks[k], head, arrays)
        if head["op"] == "push":
            self.bytes_pushed += n

    def _replay(self, k: int, request: _Request, version: int) -> None:
        """Server `k` restarted from the checkpoint of step `version`: push it the
        steps since then again, then the current one."""
        current = request.head
        sess = next(s for s in self.sessions.values() if s.gid == current["group"])
        kept = {step: req for step, req in sess.history}
        missing = [s for s in range(version, current["step"]) if s not in kept]
        if missing:
            raise RuntimeError(f"parameter server {k} ({self.servers[k]}) resumed at step "
                               f"{version}, but this worker no longer has the gradients of "
                               f"step(s) {missing} (recovery_interval="
                               f"{self.cfg.recovery_interval})")
        for s in range(version, current["step"]):
            self.request_all({k: kept[s][k]})
        self._send(k, request)

    # ------------------------------------------------------------ training
    def held_indices(self, opt) -> Tuple[int, ...]:
        """Indices of `opt`'s parameters held by the servers."""
        return tuple(i for i, p in enumerate(opt.parameters)
                     if getattr(p, "is_param_ps", False) and p.requires_grad)

    def _session(self, opt, held: Tuple[int, ...]) -> _OptSession:
        sess = self.sessions.get(id(opt))
        if sess is not None:
            return sess
        params = opt.parameters
        owner = type(opt).__name__
        for i in held:
            p = params[i]
            if p._layout is not None:
                raise ValueError(f"{owner}: parameter {p.name!r} is stored sharded or per "
                                 "device and cannot also be held by the parameter servers; "
                                 "remove its sharding strategy or do not call set_param_ps "
                                 "on it")
        specs = {i: optimizer_spec(opt, i) for i in held}
        shards = place([(i, params[i]) for i in held], len(self.servers))
        sess = _OptSession(f"opt{len(self.sessions)}", params, held, shards)
        inits = {}
        for k, lst in shards.items():
            keys, arrays = [], []
            for sh in lst:
                p = params[sh.index]
                init = server_initialised(p)
                if init is None:
                    value = np.asarray(p._value())
                    part = value if sh.rows is None else value[sh.rows[0]:sh.rows[1]]
                    shape, dtype = part.shape, part.dtype
                else:
                    # the server makes its rows from the initializer: nothing to send
                    shape = (sh.rows[1] - sh.rows[0],) + tuple(p.shape[1:])
                    dtype, part = np.dtype(p.dtype), np.zeros(0, p.dtype)
                key = {"name": p.name, "shape": list(shape), "dtype": dtype.name,
                       "opt": specs[sh.index],
                       "rows": None if sh.rows is None else list(sh.rows),
                       "sparse": sh.sparse}
                if init is not None:
                    key["init"] = dict(describe(init), table_shape=list(p.shape))
                keys.append(key)
                arrays.append(part)
            inits[k] = _Request({"op": "init", "group": sess.gid, "worker": self.rank,
                                 "keys": keys, "step": 0}, arrays)
            sess.templates[k] = self._push_template(sess.gid, keys)
        answers = self.request_all(inits)
        self._write_values(opt, sess, answers, init=True)
        # after a step a worker's copy is current only where the answer says so: a
        # sparse table's answer carries the rows this worker caches, an async answer
        # the values of that moment (other workers push on); sync dense weights are
        # current until this worker's next push
        sess.stale = tuple(p for p in (params[i] for i in held)
                           if self.cfg.mode == "async" or _is_sparse(sess, p))
        for p in sess.stale:
            p.__dict__["ps_stale"] = True
        self.sessions[id(opt)] = sess
        return sess

    def _push_template(self, gid: str, keys: List[dict]) -> Optional[Tuple[Template, Template]]:
        """The headers of every push of the shards `keys` (their init specs) to one
        server and of its answer (the server encodes the same,
        :func:`.transport.answer_template`), encoded once; None when one of them is sparse
        (its arrays vary)."""
        if any(key["sparse"] or key["dtype"] not in _DTYPE_OF for key in keys):
            return None
        specs = [(key["dtype"], key["shape"]) for key in keys]
        return (push_template(gid, self.rank, specs), answer_template(specs))

    def _check_hybrid(self, opt, held: Tuple[int, ...]) -> None:
        if self.env.worker_num == 1:
            return
        rest = [p for i, p in enumerate(opt.parameters) if p.requires_grad and i not in held]
        if not rest:
            return
        backend = context._STATE.comm.backend
        owner = type(opt).__name__
        if getattr(backend, "name", None) != "mpi":
            raise RuntimeError(f"{owner}: parameter {rest[0].name!r} is trainable but not "
                               "held by the parameter servers, and this worker runs without "
                               f"MPI, so its {self.env.worker_num} workers cannot all-reduce "
                               "it; call net.set_param_ps() for every trainable weight, or "
                               "start the job with python -m dualmode.run --ps (workers "
                               "under MPI)")
        if context._STATE.auto_parallel.parallel_mode == "stand_alone":
            raise RuntimeError(f"{owner}: parameter {rest[0].name!r} stays on the workers but "
                               "parallel_mode='stand_alone' does not all-reduce it among the "
                               f"{self.env.worker_num} workers; set_auto_parallel_context("
                               "parallel_mode='data_parallel', gradients_mean=True)")

    def step(self, opt, gradients) -> Set[int]:
        """Push `opt`'s server-held gradients, pull the new values into the parameters;
        the indices handled (the optimizer updates the others)."""
        self._check_alive()
        sess = self.sessions.get(id(opt))
        held = sess.held if sess is not None else self.held_indices(opt)
        self._check_hybrid(opt, held)
        if not held:
            return set()
        if sess is None:
            sess = self._session(opt, held)
        params = opt.parameters
        requests = {}
        head = {"op": "push", "group": sess.gid, "worker": self.rank, "step": sess.step,
                "base": sess.version}
        for k, lst in sess.shards.items():
            templates = sess.templates[k]
            if templates is not None:
                # dense shards only: the header is encoded, only the arrays are new
                requests[k] = _Request(dict(head), [_dense_part(gradients[sh.index], sh,
                                                                params[sh.index].dtype)
                                                    for sh in lst], *templates)
                continue
            arrays = []
            for sh in lst:
                g = gradients[sh.index]
                g = g._value() if isinstance(g, TensorBase) else np.asarray(g)
                p = params[sh.index]
                if sh.sparse:
                    # the rows used since the last push, and the cached ids (the
                    # answer refreshes those of them that changed)
                    cache = self.sparse.get(id(p))
                    ids, cached = (cache.touched_ids(), cache.cached_ids()) \
                        if cache is not None else (np.zeros(0, np.int64),) * 2
                    ids = ids[(ids >= sh.rows[0]) & (ids < sh.rows[1])]
                    cached = cached[(cached >= sh.rows[0]) & (cached < sh.rows[1])]
                    arrays += [ids, np.asarray(g[ids], p.dtype), cached]
                else:
                    part = g if sh.rows is None else g[sh.rows[0]:sh.rows[1]]
                    arrays.append(np.asarray(part, p.dtype))
            requests[k] = _Request(dict(head), arrays)
        for i in held:
            cache = self.sparse.get(id(params[i]))
            if cache is not None:
                cache.clear_touched()
        if self.cfg.recovery_interval > 1:
            sess.history.append((sess.step, requests))
            while len(sess.history) > self.cfg.recovery_interval:
                sess.history.popleft()
        before = self.bytes_pushed, self.bytes_pulled
        answers = self.request_all(requests)
        self._record(self.bytes_pushed - before[0], self.bytes_pulled - before[1])
        self._write_values(opt, sess, answers)
        for p in sess.stale:
            p.__dict__["ps_stale"] = True
        sess.step += 1
        return set(held)

    def _write_values(self, opt, sess: _OptSession, answers, init: bool = False) -> None:
        params = opt.parameters
        versions = []
        for k, (head, arrays) in answers.items():
            versions.append(head.get("version", 0))
            it = iter(arrays)
            for sh in sess.shards[k]:
                p = params[sh.index]
                if sh.sparse and not init:
                    ids, rows = next(it), next(it)
                    cache = self.sparse.get(id(p))
                    if cache is not None and len(ids):
                        cache.refresh(p, ids, rows)
                    continue
                value = next(it)
                if init and "ps_initializer" in p.__dict__:
                    continue                  # initialised on the server: not sent back
                target = p._value()
                if sh.rows is not None:
                    target[sh.rows[0]:sh.rows[1]] = value
                elif value.dtype == target.dtype and value.flags.writeable \
                        and value.flags.aligned:
                    # the received frame becomes the weight's storage: no copy
                    p._data = value.reshape(target.shape)
                else:
                    np.copyto(target, value.reshape(target.shape))
        sess.version = max(versions) if versions else sess.version

    def holds(self, p) -> bool:
        """Whether the servers hold parameter `p` (an optimizer of this worker has
        placed it)."""
        return any(s.params[sh.index] is p for s in self.sessions.values()
                   for lst in s.shards.values() for sh in lst)

    def pull_rows(self, p, ids: np.ndarray) -> None:
        """Write the servers' current rows `ids` of the sparse table `p` into it."""
        self._check_alive()
        requests, where = {}, {}
        for sess in self.sessions.values():
            for k, lst in sess.shards.items():
                for key, sh in enumerate(lst):
                    if not sh.sparse or sess.params[sh.index] is not p:
                        continue
                    sel = ids[(ids >= sh.rows[0]) & (ids < sh.rows[1])]
                    if len(sel):
                        requests[k] = _Request({"op": "pull_rows", "group": sess.gid,
                                                "key": key}, [sel])
                        where[k] = sel
        if not requests:
            return
        before = self.bytes_pulled
        answers = self.request_all(requests)
        self._record(0, self.bytes_pulled - before)
        target = p._value()
        for k, (head, arrays) in answers.items():
            target[where[k]] = arrays[0]

    def refresh(self, p) -> None:
        """Make this worker's copy of the server-held parameter `p` equal to the
        servers' current value (every shard pulled, one request per server). A read of
        a parameter marked stale (``asnumpy``, numpy, ``save_checkpoint``) calls this
        first; in sync mode the copy then stays current until this worker's next step,
        in async mode other workers' pushes change the servers' value at any time, so
        it stays marked."""
        self._check_alive()
        requests, where = {}, {}
        for sess in self.sessions.values():
            for k, lst in sess.shards.items():
                for key, sh in enumerate(lst):
                    if sess.params[sh.index] is p:
                        requests[k] = _Request({"op": "pull", "group": sess.gid,
                                                "key": key}, [])
                        where[k] = sh
        if not requests:
            p.__dict__.pop("ps_stale", None)
            return
        before = self.bytes_pulled
        answers = self.request_all(requests)
        self._record(0, self.bytes_pulled - before)
        target = p._value()
        for k, (head, arrays) in answers.items():
            sh = where[k]
            if sh.rows is None:
                np.copyto(target, arrays[0].reshape(target.shape))
            else:
                target[sh.rows[0]:sh.rows[1]] = arrays[0]
        if self.cfg.mode != "async":
            p.__dict__.pop("ps_stale", None)

    def pull_tables(self, params) -> None:
        """Make every server-held parameter among `params` equal to the servers'
        value (pulled whether or not it is marked stale)."""
        for p in params:
            if self.holds(p):
                self.refresh(p)

    def _record(self, pushed: int, pulled: int) -> None:
        if trace._STATE.reports:
            if pushed:
                with trace.comm_cause("ParameterServer", "gradient"):
                    trace.record("Push", 2, 1, pushed)
            if pulled:
                with trace.comm_cause("ParameterServer", "gradient"):
                    trace.record("Pull", 2, 1, pulled)


def _refresh_on_read(p) -> None:
    """A reader is about to see `p`, marked stale: make it the servers' value."""
    worker = active_worker()
    if worker is None:
        p.__dict__.pop("ps_stale", None)
    else:
        worker.refresh(p)


register_read_hook(_refresh_on_read)


def _is_sparse(sess: _OptSession, p) -> bool:
    """Whether the servers hold `p` (a parameter of session `sess`) as a sparse table."""
    return any(sh.sparse and sess.params[sh.index] is p
               for lst in sess.shards.values() for sh in lst)


def _dense_part(g, sh: Shard, dtype) -> np.ndarray:
    """The gradient `g` of shard `sh` (its rows, or all of it) as a C-contiguous
    array of the parameter's `dtype` (a view when it already is one)."""
    g = g._value() if isinstance(g, TensorBase) else g
    if sh.rows is not None:
        g = g[sh.rows[0]:sh.rows[1]]
    a = np.asarray(g, dtype)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)
