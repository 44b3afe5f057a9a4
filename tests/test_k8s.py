"""``python -m dualmode.run --k8s mpijob|ps``: manifests parsed back with PyYAML."""
import os
import subprocess
import sys

import pytest

from dualmode import k8s

yaml = pytest.importorskip("yaml", reason="the manifests are checked with PyYAML "
                                          "(pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*flags):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "dualmode.run", *flags], env=env,
                          capture_output=True, text=True, timeout=60)


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_k8s_mpijob_has_worker_count_image_and_command():
    proc = _run("--k8s", "mpijob", "--worker_num", "4", "--image", "reg/dm:1",
                "--timeout", "30", "train.py", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["MPIJob"]
    job = docs[0]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["metadata"]["name"] == "dualmode-train"
    spec = job["spec"]
    assert spec["slotsPerWorker"] == 1 and spec["mpiImplementation"] == "MPICH"
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    worker = spec["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1 and worker["replicas"] == 4
    (lc,) = launcher["template"]["spec"]["containers"]
    (wc,) = worker["template"]["spec"]["containers"]
    assert lc["image"] == wc["image"] == "reg/dm:1"
    assert lc["command"] == ["python", "-m", "dualmode.run", "--worker_num", "4",
                             "--hostfile", "/etc/mpi/hostfile", "--timeout", "30",
                             "train.py", "--epochs", "2"]


def test_k8s_mpijob_takes_nproc_per_node_and_rank_table(tmp_path):
    docs = list(yaml.safe_load_all(_run("--k8s", "mpijob", "--nproc_per_node", "3",
                                        "x.py").stdout))
    assert docs[0]["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3


def test_k8s_ps_has_service_and_job_per_role_with_dm_variables():
    proc = _run("--k8s", "ps", "--server_num", "2", "--worker_num", "3", "--master_port",
                "4000", "my_train.py", "a")
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["Service", "Job"] * 3
    jobs = {d["metadata"]["labels"]["dualmode/role"]: d for d in docs if d["kind"] == "Job"}
    services = {d["metadata"]["labels"]["dualmode/role"]: d for d in docs
                if d["kind"] == "Service"}
    assert sorted(jobs) == sorted(services) == ["scheduler", "server", "worker"]
    counts = {"scheduler": 1, "server": 2, "worker": 3}
    roles = {"scheduler": "DM_SCHED", "server": "DM_PSERVER", "worker": "DM_WORKER"}
    for role, job in jobs.items():
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == counts[role]
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["python", "my_train.py", "a"]
        env = _env(c)
        assert env["DM_ROLE"] == roles[role]
        assert (env["DM_SERVER_NUM"], env["DM_WORKER_NUM"]) == ("2", "3")
        assert env["DM_SCHED_HOST"] == services["scheduler"]["metadata"]["name"] == \
            "dualmode-my-train-scheduler"
        assert env["DM_SCHED_PORT"] == "4000"
        assert job["spec"]["template"]["metadata"]["labels"] == \
            services[role]["spec"]["selector"]
    assert _env(jobs["server"]["spec"]["template"]["spec"]["containers"][0])[
        "DM_NODE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert services["scheduler"]["spec"]["ports"][0]["port"] == 4000


@pytest.mark.parametrize("flags, message", [
    (["--k8s", "helm", "--worker_num", "2"],
     "dualmode.run: --k8s='helm' is not valid; expected 'mpijob' or 'ps'"),
    (["--k8s", "ps", "--worker_num", "2"], "dualmode.run: --ps needs --server_num"),
    (["--k8s", "mpijob", "--worker_num", "2", "--hostfile", __file__],
     "dualmode.run: --k8s mpijob places the ranks on worker pods itself"),
])
def test_k8s_bad_flags_are_named(flags, message):
    proc = _run(*flags, "train.py")
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_k8s_yaml_round_trips_odd_strings():
    doc = {"a": ["x: y", "#z", "", "1", True, 0, None, {"b": [], "c": {}}], "d": 'q"uote'}
    assert yaml.safe_load(k8s.to_yaml([doc])) == doc
    assert k8s.job_name("dir/My Script_v2.py") == "dualmode-my-script-v2"
