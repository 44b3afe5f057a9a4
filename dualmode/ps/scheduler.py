"""The scheduler: registers servers and workers, hands out ids and the cluster map,
watches heartbeats, tells the servers which workers are gone, and ends the job.

It binds a ROUTER socket on ``DM_SCHED_HOST:DM_SCHED_PORT``; every other node talks to
it through a DEALER. Messages (JSON headers, see :mod:`.transport`):

==================  ============================================================
from a node         meaning / answer
==================  ============================================================
``register``        role, counts, mode, requested id, data address (servers);
                    answered with ``cluster`` (id, server addresses) once every
                    node has registered, or ``error``
``hb``              heartbeat; answered with ``hb_ack``
``finish``          a worker is done; when every worker is done or lost the
                    servers get ``shutdown`` and the scheduler exits
``bye``             a server has shut down
==================  ============================================================

To the servers it sends ``worker_lost`` / ``worker_done`` (sync steps go on with the
live workers). A server that registers after the cluster formed takes the place of a
server whose heartbeats stopped (a restarted server, see DM_RECOVERY_PATH).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import zmq

from .. import context
from .env import ClusterEnv
from .transport import recv, send

__all__ = ["run_scheduler", "log"]


def log(role: str, msg: str) -> None:
    """One line of a node's log (stdout, flushed: the launcher writes it to the role's
    log file)."""
    print(f"[dualmode.ps {role}] {msg}", flush=True)


@dataclass
class _Node:
    ident: bytes
    role: str
    id: int
    address: Optional[str] = None
    pid: Optional[int] = None
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "live"                 # live / finished / lost


class _Scheduler:
    def __init__(self, env: ClusterEnv, cfg: context.PSConfig):
        self.env, self.cfg = env, cfg
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self.sock.bind(env.sched_address)
        except zmq.ZMQError as exc:
            self.sock.close()
            raise RuntimeError(f"init: the scheduler cannot listen on DM_SCHED_HOST:"
                               f"DM_SCHED_PORT (MS_SCHED_HOST:MS_SCHED_PORT) = "
                               f"{env.sched_host}:{env.sched_port} ({exc}); the port is in "
                               "use or the address is not this machine's: pick a free port "
                               "or this machine's address") from None
        self.nodes: Dict[bytes, _Node] = {}
        self.servers: List[Optional[_Node]] = [None] * env.server_num
        self.workers: List[Optional[_Node]] = [None] * env.worker_num
        self.formed = False
        self.waiting_servers: List[tuple] = []      # (ident, header) of restarted servers
        self.mode = (cfg.mode, cfg.staleness)

    # ---------------------------------------------------------------- helpers
    def reply(self, ident: bytes, head: dict) -> None:
        send(self.sock, head, ident=ident)

    def refuse(self, ident: bytes, message: str) -> None:
        log("scheduler", "refused a registration: " + message)
        self.reply(ident, {"op": "error", "message": message})

    def cluster_map(self, node: _Node) -> dict:
        return {"op": "cluster", "id": node.id, "role": node.role,
                "servers": [s.address for s in self.servers],
                "server_num": self.env.server_num, "worker_num": self.env.worker_num}

    # ----------------------------------------------------------- registration
    def register(self, ident: bytes, head: dict) -> None:
        env = self.env
        role = head.get("role")
        for key, mine in (("server_num", env.server_num), ("worker_num", env.worker_num)):
            theirs = head.get(key)
            if theirs != mine:
                var = key.upper()
                return self.refuse(ident, f"DM_{var} (MS_{var})={theirs} on a {role} (pid "
                                   f"{head.get('pid')}) does not match DM_{var}={mine} on "
                                   f"the scheduler; every process needs the same value")
        mode = (head.get("mode"), head.get("staleness"))
        if mode != self.mode:
            return self.refuse(ident, f"set_ps_context(mode={mode[0]!r}, staleness={mode[1]}) "
                               f"on a {role} (pid {head.get('pid')}) differs from "
                               f"mode={self.mode[0]!r}, staleness={self.mode[1]} on the "
                               "scheduler; every process needs the same settings")
        if role == "server":
            return self.register_server(ident, head)
        if role == "worker":
            return self.register_worker(ident, head)
        return self.refuse(ident, f"role={role!r} is not valid; expected 'server' or "
                           "'worker'")

    def register_server(self, ident: bytes, head: dict) -> None:
        if self.formed:
            self.waiting_servers.append((ident, head))
            log("scheduler", f"a server (pid {head.get('pid')}) registered after the "
                "cluster formed: it takes the place of the first server found lost")
            self.replace_lost_servers()
            return
        free = [i for i, s in enumerate(self.servers) if s is None]
        if not free:
            return self.refuse(ident, f"more servers registered than DM_SERVER_NUM="
                               f"{self.env.server_num} (MS_SERVER_NUM); this one (pid "
                               f"{head.get('pid')}) is one too many")
        node = _Node(ident, "server", free[0], head.get("address"), head.get("pid"))
        self.servers[node.id] = node
        self.nodes[ident] = node
        log("scheduler", f"The server node pid {node.pid}, address {node.address} "
            f"assign rank id: {node.id}")
        self.maybe_form()

    def register_worker(self, ident: bytes, head: dict) -> None:
        if self.formed:
            return self.refuse(ident, f"a worker (pid {head.get('pid')}) registered after "
                               f"the cluster of {self.env.worker_num} workers formed; "
                               "workers cannot join a running job")
        want = head.get("rank")
        if want is not None:
            if not 0 <= want < self.env.worker_num:
                return self.refuse(ident, f"worker rank {want} (its MPI rank) is out of "
                                   f"range for DM_WORKER_NUM={self.env.worker_num}; "
                                   f"expected 0 <= rank < {self.env.worker_num}")
            if self.workers[want] is not None:
                return self.refuse(ident, f"worker rank {want} is taken twice; "
                                   f"DM_WORKER_NUM={self.env.worker_num} may be too small")
            wid = want
        else:
            free = [i for i, w in enumerate(self.workers) if w is None]
            if not free:
                return self.refuse(ident, f"more workers registered than DM_WORKER_NUM="
                                   f"{self.env.worker_num} (MS_WORKER_NUM); this one (pid "
                                   f"{head.get('pid')}) is one too many")
            wid = free[0]
        node = _Node(ident, "worker", wid, None, head.get("pid"))
        self.workers[wid] = node
        self.nodes[ident] = node
        log("scheduler", f"The worker node pid {node.pid} assign rank id: {wid}")
        self.maybe_form()

    def maybe_form(self) -> None:
        if any(s is None for s in self.servers) or any(w is None for w in self.workers):
            return
        self.formed = True
        for node in self.servers + self.workers:
            node.last_seen = time.monotonic()
            self.reply(node.ident, self.cluster_map(node))
        log("scheduler", f"Start the scheduler node is successful! {self.env.server_num} "
            f"server(s), {self.env.worker_num} worker(s)")

    def replace_lost_servers(self) -> None:
        while self.waiting_servers:
            lost = [i for i, s in enumerate(self.servers) if s.state == "lost"]
            if not lost:
                return
            ident, head = self.waiting_servers.pop(0)
            old = self.servers[lost[0]]
            self.nodes.pop(old.ident, None)
            node = _Node(ident, "server", old.id, old.address, head.get("pid"))
            self.servers[old.id] = node
            self.nodes[ident] = node
            log("scheduler", f"server {old.id} restarted (pid {node.pid}); it listens on "
                f"{old.address} again")
            msg = self.cluster_map(node)
            msg["bind"] = old.address
            self.reply(ident, msg)

    # -------------------------------------------------------------- liveness
    def to_servers(self, head: dict) -> None:
        for s in self.servers:
            if s is not None and s.state == "live":
                self.reply(s.ident, head)

    def check_heartbeats(self) -> None:
        now = time.monotonic()
        for node in list(self.nodes.values()):
            if node.state != "live" or now - node.last_seen <= self.cfg.heartbeat_timeout:
                continue
            node.state = "lost"
            gone = now - node.last_seen
            if node.role == "worker":
                live = [w.id for w in self.workers if w.state == "live"]
                log("scheduler", f"worker {node.id} (pid {node.pid}) lost: no heartbeat for "
                    f"{gone:.1f} s; the job continues with the live workers {live}")
                self.to_servers({"op": "worker_lost", "worker": node.id})
            else:
                log("scheduler", f"server {node.id} (pid {node.pid}, {node.address}) lost: "
                    f"no heartbeat for {gone:.1f} s; workers wait for it to restart")
                self.replace_lost_servers()

    def workers_done(self) -> bool:
        return self.formed and all(w.state != "live" for w in self.workers)

    # ------------------------------------------------------------------ loop
    def serve(self) -> int:
        env, cfg = self.env, self.cfg
        log("scheduler", f"listening on {env.sched_host}:{env.sched_port} for "
            f"{env.server_num} server(s) and {env.worker_num} worker(s)")
        start = time.monotonic()
        tick = min(cfg.heartbeat_interval, 0.5)
        while not self.workers_done():
            if self.sock.poll(int(tick * 1000)):
                ident, head, _ = recv(self.sock, "scheduler", router=True)
                self.handle(ident, head)
            if self.formed:
                self.check_heartbeats()
            elif time.monotonic() - start > cfg.connect_timeout:
                missing = (f"{sum(s is not None for s in self.servers)} of {env.server_num} "
                           f"server(s) and {sum(w is not None for w in self.workers)} of "
                           f"{env.worker_num} worker(s)")
                message = (f"only {missing} registered at {env.sched_host}:"
                           f"{env.sched_port} within connect_timeout={cfg.connect_timeout:g} "
                           "s; start every role with the same DM_SCHED_HOST/DM_SCHED_PORT, "
                           "DM_SERVER_NUM and DM_WORKER_NUM")
                for node in self.nodes.values():
                    self.reply(node.ident, {"op": "error", "message": message})
                log("scheduler", message)
                return 1
        finished = [w.id for w in self.workers if w.state == "finished"]
        lost = [w.id for w in self.workers if w.state == "lost"]
        log("scheduler", f"workers finished: {finished}; lost: {lost}; stopping the servers")
        self.to_servers({"op": "shutdown"})
        deadline = time.monotonic() + max(5.0, cfg.heartbeat_timeout)
        while any(s.state == "live" for s in self.servers) and time.monotonic() < deadline:
            if self.sock.poll(200):
                ident, head, _ = recv(self.sock, "scheduler", router=True)
                self.handle(ident, head)
        return 0 if finished else 1

    def handle(self, ident: bytes, head: dict) -> None:
        op = head.get("op")
        node = self.nodes.get(ident)
        if op == "register":
            return self.register(ident, head)
        if node is None:
            if op == "hb":
                self.reply(ident, {"op": "hb_ack"})
            return
        node.last_seen = time.monotonic()
        if op == "hb":
            self.reply(ident, {"op": "hb_ack"})
        elif op == "finish" and node.role == "worker" and node.state == "live":
            node.state = "finished"
            log("scheduler", f"worker {node.id} finished")
            self.to_servers({"op": "worker_done", "worker": node.id})
        elif op == "bye" and node.role == "server":
            node.state = "finished"
            log("scheduler", f"server {node.id} stopped")


def run_scheduler(env: ClusterEnv, cfg: context.PSConfig) -> int:
    """Serve the cluster until every worker is finished or lost; the exit status (0 when
    at least one worker finished)."""
    sched = _Scheduler(env, cfg)
    try:
        return sched.serve()
    finally:
        sched.sock.close()
