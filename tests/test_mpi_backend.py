"""Backend "mpi" and the launcher, with real jobs (mpiexec -n 2 and -n 4).

Every job runs in a subprocess with a timeout, so a hang fails the test instead of
blocking CI. The scripts live in tests/mpi_scripts/.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from dualmode.communication import load_rank_table

pytest.importorskip("mpi4py", reason="backend 'mpi' needs mpi4py (pip install -e '.[test]')")
if shutil.which("mpiexec") is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "mpi_scripts")
TIMEOUT = 60


def E(text):
    return re.escape(text)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run(cmd, cwd, timeout=TIMEOUT, **env):
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def mpiexec(n, script, *args, cwd, **env):
    return run(["mpiexec", "-n", str(n), sys.executable, os.path.join(SCRIPTS, script),
                *map(str, args)], cwd, **env)


def launch(*flags, cwd, **env):
    return run([sys.executable, "-m", "dualmode.run", *map(str, flags)], cwd, **env)


def script(name):
    return os.path.join(SCRIPTS, name)


# ------------------------------------------------------------------ collectives


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_collectives_match_sim_row_by_row(n, tmp_path):
    """Every collective, op, dtype and group spec (world, permuted, axis groups,
    irregular, partial, named), send_recv, a fused bucket as ONE Allreduce, cached
    sub-communicators: each rank's result equals its row of the sim result."""
    proc = mpiexec(n, "collectives.py", n, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "collectives ok:" in proc.stdout and f"on {n} ranks" in proc.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_fused_all_reduce_matches_sim_and_never_overwrites_a_held_result(n, tmp_path):
    """fused_all_reduce under "mpi" (packed into a pooled buffer, one Allreduce in place)
    equals the sim result row by row for every op, dtype (float16 by the gathered
    fallback) and group spec; a pooled buffer is reused only once every view of its
    previous result is gone, and the pool stays bounded."""
    proc = mpiexec(n, "fused_all_reduce.py", n, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused ok:" in proc.stdout and f"on {n} ranks" in proc.stdout



@pytest.mark.parametrize("n", [2, 4])
def test_mpi_fused_reduce_scatter_and_all_gather_equal_unfused(n, tmp_path):
    """fused_reduce_scatter / fused_all_gather under "mpi", through node shared memory
    and through MPI's collectives: bit for bit the unfused collectives' results on
    integer-valued data (any order is exact), the member-order sum on random floats in
    shared memory, one collective per bucket, every op, dtype, group spec and split
    axis; pooled buffers reused only once their results are dropped, the pool bounded
    (tests/mpi_scripts/fused_rs_ag.py)."""
    proc = run(["mpiexec", "-n", str(n), sys.executable, script("fused_rs_ag.py"), str(n)],
               tmp_path, timeout=180, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused rs/ag ok:" in proc.stdout and f"on {n} ranks" in proc.stdout

def test_mpi_rank_that_raises_aborts_plain_mpiexec_job(tmp_path):
    proc = mpiexec(4, "fail.py", 2, cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.seconds < 15, proc.seconds
    assert "ValueError: bad value on rank 2" in proc.stderr


def test_mpi_init_device_num_mismatch_is_named_before_any_collective(tmp_path):
    proc = mpiexec(2, "device_num.py", 3, cwd=tmp_path)
    assert proc.returncode != 0 and proc.seconds < 15
    assert ("ValueError: init: device_num=3 (set_auto_parallel_context) does not match the "
            "MPI world size 2") in proc.stderr
    ok = mpiexec(2, "device_num.py", 2, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("var, value, message", [
    ("RANK_SIZE", "3", "init: environment variable RANK_SIZE=3 does not match the MPI world "
                       "size 2"),
    ("RANK_ID", "7", "init: environment variable RANK_ID=7 does not match this process's "
                     "MPI rank"),
    ("RANK_SIZE", "two", "init: environment variable RANK_SIZE='two' is not valid"),
    ("DEVICE_ID", "-1", "init: environment variable DEVICE_ID='-1' is not valid"),
])
def test_mpi_init_checks_environment(var, value, message, tmp_path):
    proc = mpiexec(2, "device_num.py", 0, cwd=tmp_path, **{var: value})
    assert proc.returncode != 0 and proc.seconds < 15
    assert message in proc.stderr


def test_mpi_init_checks_rank_table_size(tmp_path):
    table = _table(tmp_path, [("localhost", 3)])
    proc = mpiexec(2, "device_num.py", 0, cwd=tmp_path, RANK_TABLE_FILE=table)
    assert proc.returncode != 0
    assert f"init: rank table RANK_TABLE_FILE={table!r} lists 3 devices, but the MPI world " \
           "size is 2" in proc.stderr


def test_init_mpi_outside_mpiexec_is_refused_without_initialising_mpi(tmp_path):
    code = ("import sys, dualmode.communication as c\n"
            "try:\n    c.init('mpi')\nexcept RuntimeError as e:\n    print(e)\n"
            "print('mpi4py.MPI' in sys.modules)\n")
    proc = run([sys.executable, "-c", code], tmp_path)
    assert "init: backend_name='mpi' was given, but this process was not started by " \
           "mpiexec" in proc.stdout
    assert proc.stdout.strip().endswith("False")
    proc = run([sys.executable, "-c", code.replace("'mpi'", "")], tmp_path, PMI_SIZE="4")
    assert "init: this process looks launched under MPI (PMI_SIZE=4) but PMI_RANK is not " \
           "set" in proc.stdout


# --------------------------------------------------------------------- launcher


def test_launcher_runs_job_writes_logs_and_echoes_rank0(tmp_path):
    logs = tmp_path / "logs"
    proc = launch("--worker_num", 4, "--log_dir", logs, script("hello.py"), "a", "--b",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("hello from rank 0 of 4 RANK_ID=0 RANK_SIZE=4 DEVICE_ID=0 args=['a', '--b'] "
            "backend=mpi") in proc.stdout
    assert "rank 1" not in proc.stdout and "stderr line of rank 0" in proc.stderr
    for r in range(4):
        text = (logs / f"worker_{r}.log").read_text()
        assert f"hello from rank {r} of 4 RANK_ID={r} RANK_SIZE=4 DEVICE_ID={r}" in text
        assert f"stderr line of rank {r}\n" in text


def test_launcher_default_log_dir_is_log_output(tmp_path):
    proc = launch("--worker_num", 2, script("hello.py"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "log_output")) == ["worker_0.log", "worker_1.log"]


@pytest.mark.parametrize("n, bad", [(2, 1), (4, 3), (4, 0)])
def test_launcher_failed_rank_ends_job_and_is_named(n, bad, tmp_path):
    proc = launch("--worker_num", n, "--log_dir", tmp_path, script("fail.py"), bad,
                  cwd=tmp_path)
    assert proc.returncode == 1
    # ended by the abort, not by the timeout (the others were waiting in AllReduce)
    assert proc.seconds < TIMEOUT / 2, proc.seconds
    assert (f"dualmode.run: rank {bad} failed: ValueError: bad value on rank {bad}; "
            f"traceback in {tmp_path / f'worker_{bad}.log'}") in proc.stderr
    log = (tmp_path / f"worker_{bad}.log").read_text()
    assert "Traceback (most recent call last)" in log and "fail.py" in log


def test_launcher_device_num_mismatch_names_rank_and_error(tmp_path):
    proc = launch("--worker_num", 2, "--log_dir", tmp_path, script("device_num.py"), 8,
                  cwd=tmp_path)
    assert proc.returncode == 1 and proc.seconds < TIMEOUT / 2
    assert re.search(r"dualmode\.run: rank [01] failed: ValueError: init: device_num=8 "
                     r"\(set_auto_parallel_context\) does not match the MPI world size 2",
                     proc.stderr), proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--worker_num", "0"], "dualmode.run: --worker_num=0 is not valid; expected an int >= 1"),
    ([], "dualmode.run: --worker_num is required"),
    (["--worker_num", "2", "--nnodes", "2"], "dualmode.run: --nnodes=2 needs --master_addr"),
    (["--worker_num", "2", "--nnodes", "2", "--master_addr", "h"],
     "dualmode.run: --nnodes=2 needs --master_port"),
    (["--worker_num", "3", "--nnodes", "2", "--master_addr", "h", "--master_port", "9"],
     "dualmode.run: --worker_num=3 is not divisible by --nnodes=2"),
    (["--worker_num", "2", "--nnodes", "2", "--node_rank", "2"],
     "dualmode.run: --node_rank=2 is out of range for --nnodes=2"),
    (["--worker_num", "2", "--hostfile", "nope.txt"],
     "dualmode.run: --hostfile='nope.txt' does not exist"),
    (["--worker_num", "two"], "argument --worker_num: invalid int value: 'two'"),
    (["--worker_nu", "2"], "unrecognized arguments"),
])
def test_launcher_rejects_bad_flags(flags, message, tmp_path):
    proc = launch(*flags, script("hello.py"), cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "log_output").exists()


def test_launcher_rejects_missing_script(tmp_path):
    proc = launch("--worker_num", 2, "missing.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "dualmode.run: script 'missing.py' does not exist" in proc.stderr


# ------------------------------------------------------------------- rank tables


def _table(tmp_path, servers, name="table.json", **override):
    doc = {"version": "1.0", "server_count": str(len(servers)), "server_list": [],
           "status": "completed"}
    rank = 0
    for host, count in servers:
        devices = []
        for d in range(count):
            devices.append({"device_id": str(d + 4), "device_ip": "192.1.27.6",
                            "rank_id": str(rank)})
            rank += 1
        doc["server_list"].append({"server_id": host, "device": devices,
                                   "host_nic_ip": "reserve"})
    doc.update(override)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_launcher_accepts_rank_table(tmp_path):
    table = _table(tmp_path, [("localhost", 2)])
    proc = launch("--log_dir", tmp_path, script("hello.py"), cwd=tmp_path,
                  RANK_TABLE_FILE=table)
    assert proc.returncode == 0, proc.stderr
    assert "hello from rank 0 of 2 RANK_ID=0 RANK_SIZE=2 DEVICE_ID=4" in proc.stdout
    assert "DEVICE_ID=5" in (tmp_path / "worker_1.log").read_text()


def test_launcher_rank_table_with_two_servers_writes_hostfile(tmp_path):
    # two names of this machine stand for two servers: mpiexec places 2 ranks on each
    table = _table(tmp_path, [("localhost", 2), ("127.0.0.1", 2)])
    proc = launch("--worker_num", 4, "--log_dir", tmp_path, script("hello.py"), cwd=tmp_path,
                  RANK_TABLE_FILE=table)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hostfile").read_text() == "localhost:2\n127.0.0.1:2\n"
    assert "RANK_ID=3 RANK_SIZE=4 DEVICE_ID=5" in (tmp_path / "worker_3.log").read_text()


def test_launcher_bad_rank_table_is_named_before_launch(tmp_path):
    table = _table(tmp_path, [("localhost", 2)])
    proc = launch("--worker_num", 4, "--log_dir", tmp_path / "l", script("hello.py"),
                  cwd=tmp_path, RANK_TABLE_FILE=table)
    assert proc.returncode == 2
    assert (f"dualmode.run: --worker_num=4 does not match the 2 devices of "
            f"RANK_TABLE_FILE={table!r}") in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = launch("--worker_num", 2, script("hello.py"), cwd=tmp_path,
                  RANK_TABLE_FILE=str(bad))
    assert proc.returncode == 2
    assert f"rank table RANK_TABLE_FILE={str(bad)!r}: not valid JSON (line 1" in proc.stderr
    assert not (tmp_path / "l").exists()


@pytest.mark.parametrize("override, message", [
    ({"server_count": "2"}, "server_count='2' but server_list has 1 servers"),
    ({"server_count": "x"}, "server_count='x' is not an int (or a string of digits)"),
    ({"server_list": []}, "server_list=[] is not a non-empty list"),
    ({"status": "initializing"}, "status='initializing'; a usable table has status "
                                 "'completed'"),
    ({"server_list": [{"server_id": "h", "device": [{"device_id": "0", "rank_id": "1"}]}]},
     "server_list[0] has rank_ids [1]; expected [0]"),
    ({"server_list": [{"server_id": "h", "device": [{"device_id": "0", "rank_id": "0"},
                                                    {"device_id": "0", "rank_id": "1"}]}]},
     "server_list[0] lists a device_id twice (device ids [0, 0])"),
    ({"server_list": [{"server_id": "", "device": [{"device_id": "0", "rank_id": "0"}]}]},
     "server_list[0].server_id='' is not a host name or address"),
    ({"server_list": [{"server_id": "h", "device": [{"rank_id": "0"}]}]},
     "server_list[0].device[0] has no 'device_id'"),
])
def test_rank_table_errors_name_file_key_and_value(override, message, tmp_path):
    path = _table(tmp_path, [("h", 1)], **override)
    with pytest.raises(ValueError, match=E(f"rank table RANK_TABLE_FILE={path!r}: {message}")):
        load_rank_table(path, "RANK_TABLE_FILE")


def test_rank_table_missing_file_and_good_table(tmp_path):
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match=E(f"rank table rank_table={missing!r}: cannot read "
                                           "the file (No such file or directory)")):
        load_rank_table(missing)
    t = load_rank_table(_table(tmp_path, [("a", 2), ("b", 3)]))
    assert (t.world_size, t.hosts, t.slots, t.device_ids) == \
        (5, ("a", "b"), (2, 3), ((4, 5), (4, 5, 6)))


# ----------------------------------------------------------------- several nodes


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_launcher_two_nodes_rendezvous_on_one_machine(tmp_path):
    port = _free_port()
    common = ["--worker_num", "4", "--nnodes", "2", "--master_port", str(port),
              "--log_dir", str(tmp_path)]
    follower = subprocess.Popen(
        [sys.executable, "-m", "dualmode.run", *common, "--node_rank", "1",
         "--master_addr", "localhost", script("hello.py")],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc = launch(*common, "--node_rank", 0, "--master_addr", "localhost",
                      script("hello.py"), cwd=tmp_path)
        out, err = follower.communicate(timeout=TIMEOUT)
    finally:
        follower.kill()
    assert proc.returncode == 0, proc.stderr
    assert follower.returncode == 0, err
    assert "node 1 joined localhost:" in out
    assert (tmp_path / "hostfile").read_text() == "localhost:2\n127.0.0.1:2\n"
    # DEVICE_ID counts on each node
    assert "RANK_ID=3 RANK_SIZE=4 DEVICE_ID=1" in (tmp_path / "worker_3.log").read_text()


def test_launcher_shares_the_cores_between_ranks(monkeypatch):
    from dualmode import run as launcher
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    assert launcher.threads_per_rank(4) == 2
    assert launcher.threads_per_rank(16) == 1
    assert launcher.threads_per_rank(8, nnodes=2) == 2          # 4 ranks on each machine
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: None)
    assert launcher.threads_per_rank(2) == 1
