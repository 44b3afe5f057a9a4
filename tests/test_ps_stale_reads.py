"""Reading a server-held weight on a parameter server worker gives the servers' current
value: a sparse table's rows that only the other worker used are pulled by
``asnumpy()``, ``numpy.asarray`` and ``save_checkpoint``, and a forward pass uses the
current rows; in async mode a dense weight too. Real processes (scheduler, 2 servers,
2 workers), against the single device trained on the concatenated batches; the
training steps make no extra pulls."""
import importlib.util
import os

import numpy as np
import pytest

from _ps import ROOT, Cluster

pytest.importorskip("zmq", reason="parameter server mode needs pyzmq")

SCRIPT = os.path.join(ROOT, "tests", "ps_scripts", "fault_stale_reads.py")


def _program():
    spec = importlib.util.spec_from_file_location("ps_fault_stale_reads", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Cluster(Cluster):
    """The cluster of tests/_ps.py running fault_stale_reads.py."""
    script = SCRIPT


@pytest.mark.parametrize("opt,cache", [("momentum", 0), ("momentum", 16), ("sgd", 16)])
def test_reads_of_a_sparse_table_are_the_servers_values(opt, cache, tmp_path):
    cfg = {"mode": "sync", "opt": opt, "cache": cache, "steps": 3}
    with _Cluster(tmp_path, cfg) as c:
        c.start_all()
        assert set(c.wait().values()) == {0}, c.all_logs()
    data = np.load(tmp_path / "reads_0.npz")
    as_numpy, as_array, saved, output, fc, pulls = (data[f"arr_{i}"] for i in range(6))
    ref_table, ref_fc, ref_out = _program().reference(cfg)
    mod = _program()
    other = np.unique(np.concatenate([mod.batch(s, 1)[0].ravel() for s in range(3)]))
    # worker 0 never looked up the other half: its rows came from the servers
    assert not np.allclose(ref_table[other], mod.build(cfg)[0].lookup.embedding_table
                           .asnumpy()[other])
    for got in (as_numpy, as_array, saved):
        np.testing.assert_allclose(got, ref_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fc, ref_fc, rtol=1e-5, atol=1e-6)
    # no pull while training; the first read pulled the table, later reads did not
    # (sync: current until the next step); the dense weight is never pulled
    assert pulls.tolist() == [0, 1], pulls


def test_async_reads_pull_what_other_workers_changed(tmp_path):
    cfg = {"mode": "async", "opt": "sgd", "cache": 0, "steps": 2}
    with _Cluster(tmp_path, cfg) as c:
        c.start_all()
        assert set(c.wait().values()) == {0}, c.all_logs()
    mine, latest = np.load(tmp_path / "async_0.npz"), np.load(tmp_path / "async_1.npz")
    assert int(mine["arr_2"]) == 2          # the two reads, none while training
    # worker 1 pushed after worker 0's last step: worker 0 reads the servers' latest
    for i in (0, 1):
        np.testing.assert_array_equal(mine[f"arr_{i}"], latest[f"arr_{i}"])
