"""Parameter server mode: a sync PS step (2 workers, 2 servers, every weight on the
servers) beside the AllReduce data-parallel step of the same network on 2 MPI ranks
(goal: PS <= 1.5x), and a worker's push + pull of a 4 MiB weight beside raw ZeroMQ round
trips of the same bytes (goal: >= 0.8 of the raw throughput, i.e. time ratio <= 1.25).

The steps are timed inside worker 0 / rank 0 (median after two warm-up steps), since
a launch cannot be timed per step from outside. This machine has 2 cores: the PS job
runs 5 processes on them, read the figures as overhead.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "ps_step.py")
GROUP = "parameter server: PS step vs AllReduce step; push/pull vs raw zmq"

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DM_", "MS_"))}
    env["PYTHONPATH"] = ROOT
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _last_json(out):
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def _run(cmd, tmp_path):
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _last_json(proc.stdout)


def test_allreduce_step(benchmark, record_value, tmp_path):
    benchmark.group = GROUP
    res = _run(["mpiexec", "-n", "2", sys.executable, SCRIPT, "allreduce", "30"], tmp_path)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)   # timed inside rank 0
    benchmark.extra_info["median_s"] = res["median_s"]
    record_value("allreduce step (2 ranks)", res["median_s"])


def test_ps_step(benchmark, record_value, tmp_path):
    benchmark.group = GROUP
    res = _run([sys.executable, "-m", "dualmode.run", "--ps", "--server_num", "2",
                "--worker_num", "2", "--log_dir", str(tmp_path / "logs"), SCRIPT, "ps", "30"],
               tmp_path)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["median_s"] = res["median_s"]
    ratio = record_value("PS sync step (2 workers, 2 servers)", res["median_s"],
                         "allreduce step (2 ranks)", 1.5)
    benchmark.extra_info["ratio"] = ratio


def test_raw_zmq_round_trip(benchmark, record_value):
    """The same bytes as the push/pull bench, DEALER -> ROUTER echo -> back, no copies."""
    benchmark.group = GROUP
    ctx = zmq.Context()
    port = None
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    # the echo runs in another process, as a server would
    echo = subprocess.Popen([sys.executable, "-c", (
        "import zmq,sys\nctx=zmq.Context();s=ctx.socket(zmq.ROUTER);s.bind(sys.argv[1])\n"
        "while True:\n    f=s.recv_multipart(copy=False);s.send_multipart(f,copy=False)\n"),
        addr], env=_env())
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(addr)
        payload = np.zeros(1024 * 1024 + 1024, np.float32)       # Dense(1024, 1024)
        header = json.dumps({"op": "push"}).encode()

        def round_trip():
            sock.send_multipart([header, memoryview(payload.view(np.uint8))], copy=False)
            frames = sock.recv_multipart(copy=False)
            return np.frombuffer(frames[1].buffer, np.float32)

        benchmark.pedantic(round_trip, rounds=30, iterations=1, warmup_rounds=3)
        sock.close(linger=0)
    finally:
        echo.kill()
        echo.wait(timeout=10)
        ctx.term()
    med = benchmark.stats.stats.median if getattr(benchmark, "stats", None) else None
    if med is not None:
        record_value("raw zmq round trip (4 MiB)", med)


def test_ps_push_pull(benchmark, record_value, tmp_path):
    benchmark.group = GROUP
    res = _run([sys.executable, "-m", "dualmode.run", "--ps", "--server_num", "1",
                "--worker_num", "1", "--log_dir", str(tmp_path / "logs"), SCRIPT, "pushpull",
                "30"], tmp_path)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["median_s"] = res["median_s"]
    ratio = record_value("PS push+pull (4 MiB, SGD on the server)", res["median_s"],
                         "raw zmq round trip (4 MiB)", 1.25)
    benchmark.extra_info["ratio"] = ratio
