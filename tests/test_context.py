"""Tests of dualmode.context: validated settings, seed and generator, atomic updates."""
import re

import numpy as np
import pytest

from dualmode import context


@pytest.fixture(autouse=True)
def _fresh_context():
    context.reset_context()
    yield
    context.reset_context()


def _snapshot():
    keys = ["parallel_mode", "device_num", "global_rank", "gradients_mean",
            "parameter_broadcast", "search_mode", "full_batch", "dataset_strategy",
            "all_reduce_fusion_config", "comm_fusion", "strategy_ckpt_save_file",
            "strategy_ckpt_load_file", "enable_parallel_optimizer", "pipeline_stages"]
    return ({k: context.get_auto_parallel_context(k) for k in keys},
            {k: context.get_context(k) for k in ["mode", "device_target", "device_id"]},
            context.get_algo_parameters("fully_use_devices"))


# ------------------------------------------------------------------ set_context


def test_set_context_defaults():
    assert context.PYNATIVE_MODE == 1 and context.GRAPH_MODE == 0
    assert context.get_context("mode") == context.PYNATIVE_MODE
    assert context.get_context("device_target") == "CPU"
    assert context.get_context("device_id") == 0


def test_set_context_valid_values():
    context.set_context(mode=context.GRAPH_MODE, device_target="CPU", device_id=3)
    assert context.get_context("mode") == 0
    assert context.get_context("device_id") == 3
    context.set_context(mode=context.PYNATIVE_MODE)
    assert context.get_context("mode") == 1
    assert context.get_context("device_id") == 3  # untouched keys keep their value


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"mode": 2}, ValueError,
     r"set_context: mode=2 is not valid; expected PYNATIVE_MODE \(1\) or GRAPH_MODE \(0\)"),
    ({"mode": True}, TypeError, r"set_context: mode=True has type bool"),
    ({"mode": "graph"}, TypeError, r"set_context: mode='graph' has type str"),
    ({"device_target": "GPU"}, ValueError,
     r"set_context: device_target='GPU' is not available; only 'CPU' runs here"),
    ({"device_target": "Ascend"}, ValueError, r"device_target='Ascend' .*only 'CPU'"),
    ({"device_target": "cpu"}, ValueError, r"device_target='cpu' .*'CPU'"),
    ({"device_id": -1}, ValueError,
     r"set_context: device_id=-1 is not valid; expected an int in \[0, 4095\]"),
    ({"device_id": 1.0}, TypeError, r"set_context: device_id=1.0 has type float"),
    ({"save_graphs": True}, ValueError,
     r"set_context: unknown key 'save_graphs'; valid keys are device_id, device_target, mode"),
])
def test_set_context_errors(kwargs, exc, message):
    before = _snapshot()
    with pytest.raises(exc, match=message):
        context.set_context(**kwargs)
    assert _snapshot() == before


def test_set_context_failing_call_changes_nothing():
    with pytest.raises(ValueError, match="device_target='GPU'"):
        context.set_context(device_id=5, mode=context.GRAPH_MODE, device_target="GPU")
    assert context.get_context("device_id") == 0
    assert context.get_context("mode") == context.PYNATIVE_MODE


def test_get_context_unknown_key():
    with pytest.raises(ValueError, match=r"get_context: unknown key 'seed'; valid keys are"):
        context.get_context("seed")


# ------------------------------------------------------------------------- seed


def test_seed_default_is_none_and_rng_is_deterministic():
    assert context.get_seed() is None
    expected = np.random.default_rng(0).random(3)
    np.testing.assert_array_equal(context.rng().random(3), expected)


def test_set_seed_recreates_generator():
    context.set_seed(7)
    assert context.get_seed() == 7
    first = context.rng().random(4)
    context.rng().random(10)
    context.set_seed(7)
    np.testing.assert_array_equal(context.rng().random(4), first)
    np.testing.assert_array_equal(first, np.random.default_rng(7).random(4))


@pytest.mark.parametrize("seed, exc, message", [
    (-1, ValueError, r"set_seed: seed=-1 is not valid; expected an int >= 0"),
    (1.5, TypeError, r"set_seed: seed=1.5 has type float"),
    (True, TypeError, r"set_seed: seed=True has type bool"),
])
def test_set_seed_errors(seed, exc, message):
    context.set_seed(3)
    with pytest.raises(exc, match=message):
        context.set_seed(seed)
    assert context.get_seed() == 3


def test_derived_rng_depends_on_seed_and_key_only():
    context.set_seed(11)
    a = context.derived_rng(1, 2).random(5)
    context.rng().random(100)  # drawing from rng() does not move derived streams
    np.testing.assert_array_equal(context.derived_rng(1, 2).random(5), a)
    assert not np.array_equal(context.derived_rng(1, 3).random(5), a)
    context.set_seed(12)
    assert not np.array_equal(context.derived_rng(1, 2).random(5), a)


# -------------------------------------------------------- auto parallel context


def test_auto_parallel_defaults():
    values, _, algo = _snapshot()
    assert values == {
        "parallel_mode": "stand_alone", "device_num": 1, "global_rank": 0,
        "gradients_mean": False, "parameter_broadcast": False,
        "search_mode": "sharding_propagation", "full_batch": False,
        "dataset_strategy": "data_parallel", "all_reduce_fusion_config": None,
        "comm_fusion": {}, "strategy_ckpt_save_file": None, "strategy_ckpt_load_file": None,
        "enable_parallel_optimizer": False, "pipeline_stages": 1,
    }
    assert algo is True


@pytest.mark.parametrize("key, value, expected", [
    ("parallel_mode", "stand_alone", "stand_alone"),
    ("parallel_mode", "data_parallel", "data_parallel"),
    ("parallel_mode", "semi_auto_parallel", "semi_auto_parallel"),
    ("parallel_mode", "auto_parallel", "auto_parallel"),
    ("parallel_mode", "hybrid_parallel", "hybrid_parallel"),
    ("parallel_mode", context.ParallelMode.SEMI_AUTO_PARALLEL, "semi_auto_parallel"),
    ("device_num", 1, 1),
    ("device_num", 8, 8),
    ("device_num", 4096, 4096),
    ("device_num", np.int64(4), 4),
    ("global_rank", 0, 0),
    ("global_rank", 5, 5),
    ("gradients_mean", True, True),
    ("parameter_broadcast", True, True),
    ("search_mode", "sharding_propagation", "sharding_propagation"),
    ("search_mode", "dynamic_programming", "dynamic_programming"),
    ("search_mode", "recursive_programming", "recursive_programming"),
    ("dataset_strategy", "full_batch", "full_batch"),
    ("dataset_strategy", "data_parallel", "data_parallel"),
    ("dataset_strategy", ((1, 1, 2, 4),), ((1, 1, 2, 4),)),
    ("dataset_strategy", [[2, 1], [2]], ((2, 1), (2,))),
    ("all_reduce_fusion_config", [20, 35], [20, 35]),
    ("all_reduce_fusion_config", (1,), [1]),
    ("all_reduce_fusion_config", None, None),
    ("strategy_ckpt_save_file", "/tmp/strategy.ckpt", "/tmp/strategy.ckpt"),
    ("strategy_ckpt_load_file", "./train_strategy.ckpt", "./train_strategy.ckpt"),
    ("strategy_ckpt_save_file", "", None),
    ("strategy_ckpt_load_file", None, None),
    ("enable_parallel_optimizer", False, False),
    ("pipeline_stages", 1, 1),
    ("optimizer_weight_shard_size", -1, -1),
    ("gradient_fp32_sync", True, True),
])
def test_auto_parallel_valid_values(key, value, expected):
    context.set_auto_parallel_context(**{key: value})
    assert context.get_auto_parallel_context(key) == expected


def test_auto_parallel_path_like():
    import pathlib
    context.set_auto_parallel_context(strategy_ckpt_save_file=pathlib.Path("/tmp/s.ckpt"))
    assert context.get_auto_parallel_context("strategy_ckpt_save_file") == "/tmp/s.ckpt"


MODES = "'stand_alone', 'data_parallel', 'semi_auto_parallel', 'auto_parallel', 'hybrid_parallel'"


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"parallel_mode": "semi"}, ValueError,
     "set_auto_parallel_context: parallel_mode='semi' is not valid; expected one of " + MODES),
    ({"parallel_mode": 1}, TypeError, "set_auto_parallel_context: parallel_mode=1 has type int"),
    ({"device_num": 0}, ValueError,
     r"set_auto_parallel_context: device_num=0 is not valid; expected an int in \[1, 4096\]"),
    ({"device_num": 4097}, ValueError,
     r"device_num=4097 is not valid; expected an int in \[1, 4096\]"),
    ({"device_num": True}, TypeError,
     r"device_num=True has type bool; expected an int in \[1, 4096\]"),
    ({"device_num": 8.0}, TypeError, r"device_num=8.0 has type float"),
    ({"global_rank": -1}, ValueError,
     r"global_rank=-1 is not valid; expected an int in \[0, 4095\]"),
    ({"global_rank": False}, TypeError, r"global_rank=False has type bool"),
    ({"device_num": 4, "global_rank": 4}, ValueError,
     r"global_rank=4 is out of range for device_num=4; expected 0 <= global_rank < 4"),
    ({"gradients_mean": 1}, TypeError,
     r"gradients_mean=1 has type int; expected a bool \(True or False\)"),
    ({"gradients_mean": "yes"}, TypeError, r"gradients_mean='yes' has type str"),
    ({"parameter_broadcast": 0}, TypeError, r"parameter_broadcast=0 has type int"),
    ({"search_mode": "dp"}, ValueError,
     "search_mode='dp' is not valid; expected one of 'sharding_propagation', "
     "'dynamic_programming', 'recursive_programming'"),
    ({"full_batch": 1}, TypeError, r"full_batch=1 has type int"),
    ({"dataset_strategy": "model_parallel"}, ValueError,
     r"dataset_strategy='model_parallel' is not valid; expected one of 'full_batch', "
     r"'data_parallel', or a non-empty tuple of non-empty tuples of ints >= 1"),
    ({"dataset_strategy": ()}, ValueError, r"dataset_strategy=\(\) is not valid"),
    ({"dataset_strategy": ((),)}, ValueError, r"dataset_strategy\[0\]=\(\) is not valid"),
    ({"dataset_strategy": ((1, 0),)}, ValueError,
     r"dataset_strategy\[0\]\[1\]=0 is not valid; expected an int >= 1"),
    ({"dataset_strategy": ((1, 2.0),)}, TypeError,
     r"dataset_strategy\[0\]\[1\]=2.0 has type float"),
    ({"dataset_strategy": ((1, True),)}, TypeError,
     r"dataset_strategy\[0\]\[1\]=True has type bool"),
    ({"dataset_strategy": (1, 2)}, TypeError, r"dataset_strategy\[0\]=1 has type int"),
    ({"dataset_strategy": 4}, TypeError, r"dataset_strategy=4 has type int"),
    ({"all_reduce_fusion_config": [35, 20]}, ValueError,
     r"all_reduce_fusion_config=\[35, 20\] is not valid; expected a non-empty list of "
     r"strictly increasing positive ints"),
    ({"all_reduce_fusion_config": [20, 20]}, ValueError, r"all_reduce_fusion_config=\[20, 20\]"),
    ({"all_reduce_fusion_config": [0, 3]}, ValueError, r"all_reduce_fusion_config=\[0, 3\]"),
    ({"all_reduce_fusion_config": []}, ValueError, r"all_reduce_fusion_config=\[\] is not valid"),
    ({"all_reduce_fusion_config": [1.5]}, TypeError, r"element 1.5 is not an int"),
    ({"all_reduce_fusion_config": 20}, TypeError, r"all_reduce_fusion_config=20 has type int"),
    ({"strategy_ckpt_save_file": 3}, TypeError,
     r"strategy_ckpt_save_file=3 has type int; expected a file path \(str\) or None"),
    ({"strategy_ckpt_load_file": b"x"}, TypeError, r"strategy_ckpt_load_file=b'x' has type bytes"),
    ({"enable_parallel_optimizer": None}, TypeError,
     r"enable_parallel_optimizer=None has type NoneType; expected a bool"),
    ({"pipeline_stages": 0}, ValueError, r"pipeline_stages=0 is not valid; expected an int "
                                         r"in \[1, 4096\]"),
    ({"pipeline_stages": True}, TypeError, r"pipeline_stages=True has type bool"),
    ({"full_batch": True, "dataset_strategy": "data_parallel"}, ValueError,
     r"full_batch=True contradicts dataset_strategy='data_parallel'"),
    ({"device_nums": 8}, ValueError,
     r"set_auto_parallel_context: unknown key 'device_nums'; valid keys are "
     r"all_reduce_fusion_config, auto_parallel_search_mode, comm_fusion, dataset_strategy, device_num, "),
])
def test_auto_parallel_errors(kwargs, exc, message):
    before = _snapshot()
    with pytest.raises(exc, match=message):
        context.set_auto_parallel_context(**kwargs)
    assert _snapshot() == before


@pytest.mark.parametrize("value, expected", [
    ({"allreduce": {"mode": "auto", "config": None}},
     {"allreduce": {"mode": "auto", "config": None}}),
    ({"allreduce": {"mode": "auto"}}, {"allreduce": {"mode": "auto", "config": None}}),
    ({"allreduce": {"mode": "size", "config": 32}}, {"allreduce": {"mode": "size", "config": 32}}),
    ({"allgather": {"mode": "size", "config": 0.5}},
     {"allgather": {"mode": "size", "config": 0.5}}),
    ({"reducescatter": {"mode": "auto", "config": None}},
     {"reducescatter": {"mode": "auto", "config": None}}),
    ({"allreduce": {"mode": "index", "config": [20, 35]}},
     {"allreduce": {"mode": "index", "config": [20, 35]}}),
])
def test_comm_fusion_valid(value, expected):
    context.set_auto_parallel_context(comm_fusion=value)
    assert context.get_auto_parallel_context("comm_fusion") == expected


def test_comm_fusion_merges_per_op_and_returns_copies():
    context.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 32}})
    context.set_auto_parallel_context(comm_fusion={"allgather": {"mode": "auto", "config": None}})
    got = context.get_auto_parallel_context("comm_fusion")
    assert got == {"allreduce": {"mode": "size", "config": 32},
                   "allgather": {"mode": "auto", "config": None}}
    got["allreduce"]["config"] = 1  # mutating the copy does not reach the context
    assert context.get_auto_parallel_context("comm_fusion")["allreduce"]["config"] == 32


@pytest.mark.parametrize("value, exc, message", [
    ({"broadcast": {"mode": "auto"}}, ValueError,
     r"comm_fusion has unknown key 'broadcast'; expected keys among 'openstate', 'allreduce', 'allgather', "
     r"'reducescatter'"),
    ([("allreduce", {})], TypeError, r"comm_fusion=\[.*\] has type list"),
    ({"allreduce": "auto"}, TypeError, r"comm_fusion\['allreduce'\]='auto' has type str"),
    ({"allreduce": {"config": 3}}, ValueError, r"comm_fusion\['allreduce'\]=.* has no 'mode'"),
    ({"allreduce": {"mode": "fast"}}, ValueError,
     r"comm_fusion\['allreduce'\]\['mode'\]='fast' is not valid; expected one of 'auto', "
     r"'size', 'index'"),
    ({"allgather": {"mode": "index", "config": [2]}}, ValueError,
     r"comm_fusion\['allgather'\]\['mode'\]='index' is not valid; expected one of 'auto', 'size'"),
    ({"allreduce": {"mode": "auto", "config": 64}}, ValueError,
     r"comm_fusion\['allreduce'\]\['config'\]=64 is not valid; expected None with mode 'auto'"),
    ({"allreduce": {"mode": "size", "config": 0}}, ValueError,
     r"comm_fusion\['allreduce'\]\['config'\]=0 is not valid; expected a positive number of MB"),
    ({"allreduce": {"mode": "size", "config": None}}, TypeError,
     r"comm_fusion\['allreduce'\]\['config'\]=None has type NoneType"),
    ({"allreduce": {"mode": "size", "config": True}}, TypeError,
     r"comm_fusion\['allreduce'\]\['config'\]=True has type bool"),
    ({"allreduce": {"mode": "index", "config": [3, 1]}}, ValueError,
     r"comm_fusion\['allreduce'\]\['config'\]=\[3, 1\] is not valid; expected a non-empty list"),
    ({"allreduce": {"mode": "size", "config": 3, "extra": 1}}, ValueError,
     r"comm_fusion\['allreduce'\] has unknown key 'extra'"),
])
def test_comm_fusion_errors(value, exc, message):
    context.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 8}})
    before = _snapshot()
    with pytest.raises(exc, match="set_auto_parallel_context: " + message):
        context.set_auto_parallel_context(comm_fusion=value)
    assert _snapshot() == before


def test_full_batch_and_dataset_strategy_are_one_setting():
    context.set_auto_parallel_context(full_batch=True)
    assert context.get_auto_parallel_context("dataset_strategy") == "full_batch"
    context.set_auto_parallel_context(full_batch=False)
    assert context.get_auto_parallel_context("dataset_strategy") == "data_parallel"
    context.set_auto_parallel_context(dataset_strategy=((1, 2),))
    assert context.get_auto_parallel_context("full_batch") is False
    context.set_auto_parallel_context(full_batch=False)  # keeps the explicit strategy
    assert context.get_auto_parallel_context("dataset_strategy") == ((1, 2),)
    context.set_auto_parallel_context(dataset_strategy="full_batch")
    assert context.get_auto_parallel_context("full_batch") is True
    context.set_auto_parallel_context(full_batch=True, dataset_strategy="full_batch")
    assert context.get_auto_parallel_context("full_batch") is True


def test_global_rank_checked_against_earlier_device_num():
    context.set_auto_parallel_context(global_rank=3)
    before = _snapshot()
    with pytest.raises(ValueError, match=r"global_rank=3 is out of range for device_num=2"):
        context.set_auto_parallel_context(device_num=2)
    assert _snapshot() == before
    context.set_auto_parallel_context(device_num=4)
    assert context.get_auto_parallel_context("device_num") == 4
    assert context.get_auto_parallel_context("global_rank") == 3


def test_auto_parallel_failing_call_changes_nothing():
    context.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel")
    before = _snapshot()
    with pytest.raises(ValueError, match="search_mode='greedy'"):
        context.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4,
                                          gradients_mean=True, search_mode="greedy")
    assert _snapshot() == before


def test_device_num_none_reverts_to_backend():
    context.set_auto_parallel_context(device_num=8)
    context.set_auto_parallel_context(device_num=None)
    assert context.get_auto_parallel_context("device_num") == 1


def test_all_reduce_fusion_config_returned_as_copy():
    context.set_auto_parallel_context(all_reduce_fusion_config=[2, 5])
    got = context.get_auto_parallel_context("all_reduce_fusion_config")
    got.append(9)
    assert context.get_auto_parallel_context("all_reduce_fusion_config") == [2, 5]


def test_reset_auto_parallel_context():
    default = _snapshot()
    context.set_auto_parallel_context(
        parallel_mode="semi_auto_parallel", device_num=8, global_rank=1, gradients_mean=True,
        parameter_broadcast=True, search_mode="recursive_programming", full_batch=True,
        all_reduce_fusion_config=[3], comm_fusion={"allreduce": {"mode": "auto"}},
        strategy_ckpt_save_file="a", strategy_ckpt_load_file="b",
        enable_parallel_optimizer=False, pipeline_stages=1)
    assert _snapshot() != default
    context.reset_auto_parallel_context()
    assert _snapshot() == default


def test_get_auto_parallel_context_unknown_key():
    with pytest.raises(ValueError, match=r"get_auto_parallel_context: unknown key 'mode'; "
                                         r"valid keys are all_reduce_fusion_config"):
        context.get_auto_parallel_context("mode")


# ---------------------------------------------------------------- algo parameters


def test_algo_parameters():
    assert context.get_algo_parameters("fully_use_devices") is True
    context.set_algo_parameters(fully_use_devices=False)
    assert context.get_algo_parameters("fully_use_devices") is False
    context.reset_algo_parameters()
    assert context.get_algo_parameters("fully_use_devices") is True


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"fully_use_devices": 1}, TypeError,
     r"set_algo_parameters: fully_use_devices=1 has type int; expected a bool"),
    ({"elementwise": True}, ValueError,
     r"set_algo_parameters: unknown key 'elementwise'; valid keys are fully_use_devices"),
])
def test_algo_parameters_errors(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        context.set_algo_parameters(**kwargs)
    assert context.get_algo_parameters("fully_use_devices") is True


def test_get_algo_parameters_unknown_key():
    with pytest.raises(ValueError, match=re.escape(
            "get_algo_parameters: unknown key 'x'; valid keys are fully_use_devices")):
        context.get_algo_parameters("x")


# ------------------------------------------------------------------- reset_context


def test_reset_context_restores_everything():
    state = context._STATE
    context.set_context(mode=context.GRAPH_MODE, device_id=2)
    context.set_seed(5)
    context.set_auto_parallel_context(device_num=4)
    context.set_algo_parameters(fully_use_devices=False)
    context.reset_context()
    assert context._STATE is state  # one instance, reset in place
    assert context.get_context("mode") == context.PYNATIVE_MODE
    assert context.get_context("device_id") == 0
    assert context.get_seed() is None
    assert context.get_auto_parallel_context("device_num") == 1
    assert context.get_algo_parameters("fully_use_devices") is True
    np.testing.assert_array_equal(context.rng().random(2), np.random.default_rng(0).random(2))


# ----------------------------------------------- keys dualmode does not implement


@pytest.mark.parametrize("key, value, what", [
    ("gradient_fp32_sync", False, "fp16 gradient AllReduce"),
    ("loss_repeated_mean", False, "loss_repeated_mean=False"),
    ("auto_pipeline", True, "pipeline parallelism"),
])
def test_unimplemented_key_refused_by_name_state_unchanged(key, value, what):
    context.set_auto_parallel_context(device_num=4)
    before = _snapshot()
    with pytest.raises(ValueError, match=re.escape(
            f"set_auto_parallel_context: {key}={value!r} is not supported: dualmode does not "
            f"implement {what}")):
        context.set_auto_parallel_context(device_num=8, **{key: value})
    assert _snapshot() == before


def test_unknown_key_lists_supported_and_default_only_keys():
    with pytest.raises(ValueError) as info:
        context.set_auto_parallel_context(pipeline_stage=2)
    found = re.fullmatch(
        r"set_auto_parallel_context: unknown key 'pipeline_stage'; valid keys are (.*); "
        r"accepted at their default value only \(not implemented\): (.*)", str(info.value))
    assert found, str(info.value)
    valid, default_only = found.group(1).split(", "), found.group(2).split(", ")
    assert valid == sorted(valid) and default_only == sorted(default_only)
    assert {"all_reduce_fusion_config", "auto_parallel_search_mode", "comm_fusion",
            "dataset_strategy", "device_num", "enable_alltoall", "full_batch", "global_rank",
            "gradients_mean", "group_ckpt_save_file", "parallel_mode", "parameter_broadcast",
            "search_mode", "sharding_propagation", "strategy_ckpt_config",
            "strategy_ckpt_load_file", "strategy_ckpt_save_file"} <= set(valid)
    assert "auto_pipeline" in default_only and not set(valid) & set(default_only)
