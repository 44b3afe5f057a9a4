"""Start a parameter server cluster of real processes for a test, and always clean up.

    with Cluster(tmp_path, cfg, servers=2, workers=2) as c:
        c.start_all()
        c.wait()                       # every process exits (timeout: fails the test)
        weights = c.weights(0)

Each process runs tests/ps_scripts/train_ps.py with its role in the environment and
its own log in ``tmp_path``; every process is started in its own session and killed
(the whole group) when the block ends, whatever happened.
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "ps_scripts", "train_ps.py")


def program():
    """The training script as a module (its ``reference`` is the single-device oracle)."""
    spec = importlib.util.spec_from_file_location("ps_train_program", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(prefix="DM", servers=2, workers=2, port=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID", "DM_", "MS_"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.update({f"{prefix}_SERVER_NUM": str(servers), f"{prefix}_WORKER_NUM": str(workers),
                f"{prefix}_SCHED_HOST": "127.0.0.1",
                f"{prefix}_SCHED_PORT": str(port or free_port())})
    return env


class Cluster:
    script = SCRIPT          # the program every role runs

    """Scheduler, servers and workers running train_ps.py with `cfg`."""

    def __init__(self, tmp_path, cfg, servers=2, workers=2, env=None, timeout=60.0):
        self.dir = str(tmp_path)
        self.cfg = cfg
        self.servers, self.workers = servers, workers
        self.env = env or base_env("DM", servers, workers)
        self.timeout = timeout
        self.procs = {}                 # name -> Popen
        self.logs = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill_all()

    def start(self, role, name, extra_env=None):
        env = dict(self.env, DM_ROLE=role, **(extra_env or {}))
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self.logs[name] = log.name
        self.procs[name] = subprocess.Popen(
            [sys.executable, self.script, json.dumps(self.cfg), self.dir], cwd=self.dir, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self.procs[name]

    def start_all(self, extra_env=None):
        self.start("DM_SCHED", "scheduler", extra_env)
        for i in range(self.servers):
            self.start("DM_PSERVER", f"server_{i}", extra_env)
        for i in range(self.workers):
            self.start("DM_WORKER", f"worker_{i}", extra_env)

    def wait(self, names=None, timeout=None):
        """Wait for the processes `names` (default all) to exit; their exit codes.
        A process still running after `timeout` fails the test with every log."""
        end = time.monotonic() + (timeout or self.timeout)
        names = list(names or self.procs)
        for name in names:
            left = end - time.monotonic()
            try:
                self.procs[name].wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout or self.timeout} "
                                     f"s\n{self.all_logs()}") from None
        return {n: self.procs[n].returncode for n in names}

    def log(self, name):
        with open(self.logs[name], encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def all_logs(self):
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.logs)

    def wait_for_log(self, name, text, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.log(name):
                return
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in {name}'s log after {timeout} s\n"
                             + self.all_logs())

    def kill(self, name, sig=signal.SIGKILL):
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def kill_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def result(self, rank):
        """(losses, [push bytes, pull bytes], weights) written by worker `rank`."""
        data = np.load(os.path.join(self.dir, f"worker_{rank}.npz"))
        return (data["arr_0"], data["arr_1"],
                [data[f"arr_{i}"] for i in range(2, len(data.files))])
