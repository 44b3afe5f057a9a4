"""The role of this process, from the environment (DM_* names, MindSpore's MS_* too).

=================  =====================  ==============================================
DM name            MindSpore name         value
=================  =====================  ==============================================
DM_ROLE            MS_ROLE                DM_SCHED / DM_PSERVER / DM_WORKER (or MS_SCHED,
                                          MS_PSERVER, MS_WORKER)
DM_SERVER_NUM      MS_SERVER_NUM          servers in the job, >= 1
DM_WORKER_NUM      MS_WORKER_NUM          workers in the job, >= 1
DM_SCHED_HOST      MS_SCHED_HOST          the scheduler's address
DM_SCHED_PORT      MS_SCHED_PORT          the scheduler's port
DM_RECOVERY_PATH   MS_RECOVERY_PATH       servers checkpoint their shards here (optional)
DM_NODE_HOST       -                      the address this server advertises (optional)
=================  =====================  ==============================================

When both spellings are set they must agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from .transport import check_host, check_port

__all__ = ["ClusterEnv", "read_env", "ROLES"]

ROLES = {"DM_SCHED": "scheduler", "MS_SCHED": "scheduler",
         "DM_PSERVER": "server", "MS_PSERVER": "server",
         "DM_WORKER": "worker", "MS_WORKER": "worker"}
_MAX_NODES = 4096


@dataclass(frozen=True)
class ClusterEnv:
    """The validated environment of one process of the cluster."""

    role: str                      # "scheduler", "server" or "worker"
    server_num: int
    worker_num: int
    sched_host: str
    sched_port: int
    recovery_path: Optional[str]
    node_host: Optional[str]

    @property
    def sched_address(self) -> str:
        return f"tcp://{self.sched_host}:{self.sched_port}"


def _get(name: str, required: bool = True) -> Tuple[str, Optional[str]]:
    """(the variable's name as set, its value): DM_<name>, else MS_<name>."""
    dm, ms = "DM_" + name, "MS_" + name
    a, b = os.environ.get(dm), os.environ.get(ms)
    if a is not None and b is not None and a != b:
        raise ValueError(f"init: {dm}={a!r} and {ms}={b!r} disagree; set one of them (or "
                         "both to the same value)")
    if a is not None:
        return dm, a
    if b is not None:
        return ms, b
    if required:
        raise ValueError(f"init: set_ps_context(enable_ps=True) needs the environment "
                         f"variable {dm} (or {ms}) to be set")
    return dm, None


def _count(name: str) -> int:
    var, value = _get(name)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= _MAX_NODES:
        raise ValueError(f"init: {var}={value!r} is not valid; expected an int in "
                         f"[1, {_MAX_NODES}]")
    return n


def read_env() -> ClusterEnv:
    """The role and cluster of this process (ValueError naming the variable, its value
    and what is valid)."""
    var, role = _get("ROLE")
    if role not in ROLES:
        raise ValueError(f"init: {var}={role!r} is not a parameter server role; expected "
                         "one of " + ", ".join(repr(r) for r in ROLES))
    servers, workers = _count("SERVER_NUM"), _count("WORKER_NUM")
    hvar, host = _get("SCHED_HOST")
    host = check_host(f"init: {hvar}", host)
    pvar, port = _get("SCHED_PORT")
    port = check_port(f"init: {pvar}", port)
    _, recovery = _get("RECOVERY_PATH", required=False)
    node_host = os.environ.get("DM_NODE_HOST") or None
    return ClusterEnv(ROLES[role], servers, workers, host, port, recovery or None, node_host)
