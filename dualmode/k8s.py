"""Kubernetes manifests for a dualmode job: ``python -m dualmode.run --k8s mpijob|ps ...``.

``mpijob``: one ``MPIJob`` of the kubeflow MPI operator (``kubeflow.org/v2beta1``,
``mpiImplementation: MPICH``): a launcher pod that runs ``python -m dualmode.run
--worker_num N --hostfile /etc/mpi/hostfile script args`` (the operator mounts the
hostfile of the worker pods there) and ``N`` worker pods of one slot each, which MPICH's
``mpiexec`` reaches over ssh. The image must hold dualmode with its ``mpi`` extra, the
script and an ssh server (as the operator's MPICH base images do).

``ps``: for each parameter-server role (scheduler, server, worker) a headless
``Service`` and a ``Job`` (``completions = parallelism =`` the role's count) whose pods
carry ``DM_ROLE``, ``DM_SERVER_NUM``, ``DM_WORKER_NUM``, ``DM_SCHED_HOST`` (the
scheduler's Service name) and ``DM_SCHED_PORT``; servers advertise their pod IP as
``DM_NODE_HOST``. The workers run without MPI, so every trained weight must live on the
servers (``set_param_ps``); a hybrid job (weights all-reduced among workers) needs the
workers in an MPIJob.

The YAML is written here (block style, strings JSON-quoted), so printing manifests needs
no YAML library.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["mpijob_manifests", "ps_manifests", "to_yaml", "job_name"]

DEFAULT_IMAGE = "dualmode:latest"
HOSTFILE = "/etc/mpi/hostfile"
DEFAULT_SCHED_PORT = 29500


def job_name(script: str) -> str:
    """A DNS-1123 name for the job from the script's file name (``train.py`` ->
    ``dualmode-train``)."""
    stem = os.path.splitext(os.path.basename(script))[0].lower()
    stem = re.sub(r"[^a-z0-9-]+", "-", stem).strip("-") or "job"
    return ("dualmode-" + stem)[:52].rstrip("-")


def _env(pairs: Dict[str, str]) -> List[Dict[str, Any]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items()]


def mpijob_manifests(script: str, args: Sequence[str], worker_num: int,
                     image: Optional[str] = None, name: Optional[str] = None,
                     timeout: Optional[float] = None) -> List[Dict[str, Any]]:
    """The MPIJob running ``script args`` as ``worker_num`` ranks (one per worker pod)."""
    name = name or job_name(script)
    image = image or DEFAULT_IMAGE
    command = ["python", "-m", "dualmode.run", "--worker_num", str(worker_num),
               "--hostfile", HOSTFILE]
    if timeout is not None:
        command += ["--timeout", f"{timeout:g}"]
    command += [script, *args]
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "dualmode"}
    return [{
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "slotsPerWorker": 1,
            "mpiImplementation": "MPICH",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [{
                    "name": "launcher", "image": image, "command": command,
                    "env": _env({"OMP_NUM_THREADS": "1"})}]}}},
                "Worker": {"replicas": worker_num, "template": {"spec": {"containers": [{
                    "name": "worker", "image": image,
                    "env": _env({"OMP_NUM_THREADS": "1"})}]}}},
            },
        },
    }]


def ps_manifests(script: str, args: Sequence[str], server_num: int, worker_num: int,
                 image: Optional[str] = None, name: Optional[str] = None,
                 port: Optional[int] = None) -> List[Dict[str, Any]]:
    """A headless Service and a Job for each parameter-server role."""
    name = name or job_name(script)
    image = image or DEFAULT_IMAGE
    port = port or DEFAULT_SCHED_PORT
    sched_host = f"{name}-scheduler"
    common = {"DM_SERVER_NUM": server_num, "DM_WORKER_NUM": worker_num,
              "DM_SCHED_HOST": sched_host, "DM_SCHED_PORT": port}
    out: List[Dict[str, Any]] = []
    for role, value, count in (("scheduler", "DM_SCHED", 1), ("server", "DM_PSERVER", server_num),
                               ("worker", "DM_WORKER", worker_num)):
        labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "dualmode",
                  "dualmode/role": role}
        env = _env(dict(common, DM_ROLE=value))
        if role == "server":
            env.append({"name": "DM_NODE_HOST",
                        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        service = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": f"{name}-{role}", "labels": labels},
                   "spec": {"clusterIP": "None", "selector": labels}}
        if role == "scheduler":
            service["spec"]["ports"] = [{"name": "scheduler", "port": port,
                                         "targetPort": port}]
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": f"{name}-{role}", "labels": labels},
               "spec": {"completions": count, "parallelism": count, "backoffLimit": 0,
                        "template": {"metadata": {"labels": labels},
                                     "spec": {"restartPolicy": "Never",
                                              "subdomain": f"{name}-{role}",
                                              "containers": [{
                                                  "name": role, "image": image,
                                                  "command": ["python", script, *args],
                                                  "env": env}]}}}}
        out += [service, job]
    return out


# ------------------------------------------------------------------------ YAML


def _scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))      # a JSON string is a YAML double-quoted scalar


def _emit(v: Any, indent: int, lines: List[str]) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        for k, item in v.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{k}:")
                _emit(item, indent + 2, lines)
            else:
                lines.append(f"{pad}{k}: {_scalar(item)}")
    else:
        for item in v:
            if isinstance(item, (dict, list)) and item:
                sub: List[str] = []
                _emit(item, indent + 2, sub)
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines.extend(sub[1:])
            else:
                lines.append(f"{pad}- {_scalar(item)}")


def to_yaml(docs: Sequence[Dict[str, Any]]) -> str:
    """The documents as one YAML stream (``---`` between documents)."""
    parts = []
    for doc in docs:
        lines: List[str] = []
        _emit(doc, 0, lines)
        parts.append("\n".join(lines) + "\n")
    return "---\n" + "---\n".join(parts)
