"""Process-wide settings: execution mode, seed, auto-parallel and algorithm parameters.

All global state of dualmode lives in the single :class:`ContextState` instance held by
this module. Every setter validates *all* of its keyword arguments first and only then
applies them, so a call that raises leaves the state exactly as it was.

Error messages name the function, the key, the offending value and what is valid::

    set_auto_parallel_context: parallel_mode='semi' is not valid; expected one of
    'stand_alone', 'data_parallel', 'semi_auto_parallel', 'auto_parallel', 'hybrid_parallel'

``TypeError`` is raised for a value of the wrong type (``True`` is not accepted where an
int is expected, nor ``1`` where a bool is), ``ValueError`` for a value of the right type
outside the valid set, and for unknown keys.
"""
from __future__ import annotations

import copy
import dataclasses
import numbers
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

__all__ = [
    "PYNATIVE_MODE",
    "GRAPH_MODE",
    "ParallelMode",
    "ContextState",
    "set_context",
    "get_context",
    "set_seed",
    "get_seed",
    "rng",
    "derived_rng",
    "set_auto_parallel_context",
    "get_auto_parallel_context",
    "reset_auto_parallel_context",
    "set_algo_parameters",
    "get_algo_parameters",
    "reset_algo_parameters",
    "reset_context",
    "PSConfig",
    "set_ps_context",
    "get_ps_context",
    "reset_ps_context",
]

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_MAX_DEVICE_NUM = 4096
#: pipeline_config's default (MindSpore's): one stage per device group, 1F1B order
_PIPELINE_DEFAULTS = types.MappingProxyType({"pipeline_interleave": False,
                                             "pipeline_scheduler": "1f1b"})


class ParallelMode:
    """The valid values of ``parallel_mode`` (as ``mindspore.ParallelMode``)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    MODE_LIST = (STAND_ALONE, DATA_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL, HYBRID_PARALLEL)


_SEARCH_MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming")
_DATASET_STRATEGY_NAMES = ("full_batch", "data_parallel")
_COMM_FUSION_OPS = ("allreduce", "allgather", "reducescatter")
_COMM_FUSION_MODES = {
    "allreduce": ("auto", "size", "index"),
    # MindSpore fuses AllGather / ReduceScatter by size only; "index" is rejected as there.
    "allgather": ("auto", "size"),
    "reducescatter": ("auto", "size"),
}


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class AutoParallelConfig:
    """Values of :func:`set_auto_parallel_context`; ``None`` means "from the backend".

    ``full_batch`` is not stored: it reads as ``dataset_strategy == "full_batch"``.
    ``comm_fusion`` maps an op name to ``(mode, config)``.
    """

    parallel_mode: str = ParallelMode.STAND_ALONE
    device_num: Optional[int] = None
    #: pipeline parallelism's settings: ``{"pipeline_interleave": False,
    #: "pipeline_scheduler": "1f1b" | "gpipe"}`` (read-only); the stage count is
    #: ``pipeline_stages`` below
    pipeline_config: Mapping[str, Any] = field(default_factory=lambda: _PIPELINE_DEFAULTS)
    global_rank: Optional[int] = None
    gradients_mean: bool = False
    parameter_broadcast: bool = False
    search_mode: str = "sharding_propagation"
    dataset_strategy: Any = "data_parallel"
    all_reduce_fusion_config: Optional[Tuple[int, ...]] = None
    comm_fusion: Mapping[str, Tuple[str, Any]] = field(default_factory=dict)
    strategy_ckpt_save_file: Optional[str] = None
    strategy_ckpt_load_file: Optional[str] = None
    strategy_ckpt_only_trainable_params: bool = True
    group_ckpt_save_file: Optional[str] = None
    enable_alltoall: bool = True
    enable_parallel_optimizer: bool = False
    parallel_optimizer_config: Mapping[str, Any] = field(default_factory=dict)
    pipeline_stages: int = 1


@dataclass(frozen=True)
class AlgoParameters:
    """Values of :func:`set_algo_parameters`."""

    fully_use_devices: bool = True


@dataclass(frozen=True)
class RunConfig:
    """Values of :func:`set_context`."""

    mode: int = PYNATIVE_MODE
    device_target: str = "CPU"
    device_id: int = 0


def _new_generator(seed: Optional[int]) -> np.random.Generator:
    return np.random.default_rng(0 if seed is None else seed)


@dataclass(frozen=True)
class PSConfig:
    """Values of :func:`set_ps_context` (parameter server mode)."""

    enable_ps: bool = False
    mode: str = "sync"
    staleness: Optional[int] = None
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    connect_timeout: float = 60.0
    recovery_interval: int = 1


@dataclass
class CommState:
    """The process's live communication backend and its named groups (written by
    :mod:`dualmode.communication`; ``reset_context`` leaves it alone: a backend is
    closed by ``communication.init``/``release``, not by resetting settings)."""

    backend: Any = None
    groups: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    member_arrays: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ContextState:
    """All of dualmode's process-wide state; there is one instance, in this module.

    The three configuration records are immutable; setters replace them whole, which is
    what makes a failing call leave no trace.
    """

    run: RunConfig = field(default_factory=RunConfig)
    auto_parallel: AutoParallelConfig = field(default_factory=AutoParallelConfig)
    algo: AlgoParameters = field(default_factory=AlgoParameters)
    seed: Optional[int] = None
    generator: np.random.Generator = field(default_factory=lambda: _new_generator(None))
    comm: CommState = field(default_factory=CommState)
    ps: PSConfig = field(default_factory=PSConfig)
    #: the live parameter-server role of this process (a worker's client), set by
    #: :mod:`dualmode.ps` at ``init()``; ``reset_context`` leaves it alone, as ``comm``
    ps_role: Any = None


_STATE = ContextState()

#: functions called with the new AutoParallelConfig before set_auto_parallel_context
#: applies it (communication rebuilds a "sim" backend for a new device_num); one that
#: raises leaves the context unchanged
_AUTO_PARALLEL_HOOKS: list = []


def reset_context() -> None:
    """Restore every setting of this module to its default (for tests and notebooks).

    Resets :func:`set_context` keys, the seed and random generator, the auto-parallel
    context and the algorithm parameters.
    """
    fresh = ContextState()
    for f in dataclasses.fields(ContextState):
        if f.name not in ("comm", "ps_role"):
            setattr(_STATE, f.name, getattr(fresh, f.name))
    _leave_pipeline_stage()


def _leave_pipeline_stage() -> None:
    """After a reset (pipeline_stages back to 1) the parallel layer runs on the whole
    job's backend again, not on a pipeline stage's."""
    b = _STATE.comm.backend
    if b is not None and getattr(b, "world", None) is not None:
        _STATE.comm.backend = b.world


# ---------------------------------------------------------------- validation helpers


def _fmt_choices(choices) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


def _type_error(func: str, key: str, value: Any, expected: str) -> TypeError:
    return TypeError(
        f"{func}: {key}={value!r} has type {type(value).__name__}; expected {expected}")


def _value_error(func: str, key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{func}: {key}={value!r} is not valid; expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _check_bool(func: str, key: str, value: Any) -> bool:
    if not _is_bool(value):
        raise _type_error(func, key, value, "a bool (True or False)")
    return bool(value)


def _check_int_range(func: str, key: str, value: Any, lo: int, hi: Optional[int]) -> int:
    expected = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
    if not _is_int(value):
        raise _type_error(func, key, value, expected)
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise _value_error(func, key, value, expected)
    return value


def _check_choice(func: str, key: str, value: Any, choices) -> str:
    if not isinstance(value, str):
        raise _type_error(func, key, value, "a str, " + _fmt_choices(choices))
    if value not in choices:
        raise _value_error(func, key, value, _fmt_choices(choices))
    return value


def _check_increasing_positive_ints(func: str, key: str, value: Any) -> Tuple[int, ...]:
    expected = "a non-empty list of strictly increasing positive ints, e.g. [20, 35]"
    if not isinstance(value, (list, tuple)):
        raise _type_error(func, key, value, expected)
    if len(value) == 0:
        raise _value_error(func, key, value, expected)
    for item in value:
        if not _is_int(item):
            raise _type_error(func, key, value, expected + f" (element {item!r} is not an int)")
    ints = tuple(int(v) for v in value)
    if ints[0] < 1 or any(b <= a for a, b in zip(ints, ints[1:])):
        raise _value_error(func, key, value, expected)
    return ints


def _check_path(func: str, key: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _type_error(func, key, value, "a file path (str) or None")
    return value or None  # MindSpore's "" means "not set"


def _validate(func: str, kwargs: Dict[str, Any],
              checkers: Mapping[str, Callable[[str, str, Any], Any]]) -> Dict[str, Any]:
    """Check every key and value; return the normalised values (nothing is applied)."""
    unknown = [k for k in kwargs if k not in checkers]
    if unknown:
        raise ValueError(f"{func}: unknown key {unknown[0]!r}; " + _valid_keys(checkers))
    return {key: checkers[key](func, key, value) for key, value in kwargs.items()}


def _valid_keys(checkers) -> str:
    supported = sorted(k for k in checkers if k not in _UNSUPPORTED_AUTO_PARALLEL)
    text = "valid keys are " + ", ".join(supported)
    known = sorted(k for k in checkers if k in _UNSUPPORTED_AUTO_PARALLEL)
    if known:
        text += ("; accepted at their default value only (not implemented): "
                 + ", ".join(known))
    return text


def _check_key(func: str, key: Any, valid) -> None:
    if not isinstance(key, str) or key not in valid:
        raise ValueError(f"{func}: unknown key {key!r}; " + _valid_keys(valid))


# ------------------------------------------------------------------- set_context


def _check_mode(func: str, key: str, value: Any) -> int:
    expected = f"PYNATIVE_MODE ({PYNATIVE_MODE}) or GRAPH_MODE ({GRAPH_MODE})"
    if not _is_int(value):
        raise _type_error(func, key, value, expected)
    if value not in (PYNATIVE_MODE, GRAPH_MODE):
        raise _value_error(func, key, value, expected)
    return int(value)


def _check_device_target(func: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(func, key, value, "'CPU'")
    if value != "CPU":
        raise ValueError(f"{func}: {key}={value!r} is not available; only 'CPU' runs here "
                         "(devices are simulated on the CPU); expected one of 'CPU'")
    return value


_CONTEXT_CHECKERS: Dict[str, Callable[[str, str, Any], Any]] = {
    "mode": _check_mode,
    "device_target": _check_device_target,
    "device_id": lambda f, k, v: _check_int_range(f, k, v, 0, _MAX_DEVICE_NUM - 1),
}


def set_context(**kwargs: Any) -> None:
    """Set execution settings.

    Parameters
    ----------
    mode : int
        ``PYNATIVE_MODE`` (1, default: run ops eagerly) or ``GRAPH_MODE`` (0: compile
        whole ``Cell``s).
    device_target : str
        Only ``"CPU"``; the devices are simulated on it.
    device_id : int
        Physical device index, in ``[0, 4095]``; default 0.

    Raises
    ------
    ValueError
        An unknown key or a value outside the valid set; nothing is changed.
    TypeError
        A value of the wrong type; nothing is changed.
    """
    values = _validate("set_context", kwargs, _CONTEXT_CHECKERS)
    _STATE.run = dataclasses.replace(_STATE.run, **values)


def get_context(key: str) -> Any:
    """Return the value of one :func:`set_context` key."""
    _check_key("get_context", key, _CONTEXT_CHECKERS)
    return getattr(_STATE.run, key)


# -------------------------------------------------------------------------- seed


def set_seed(seed: int) -> None:
    """Seed every random draw of dualmode (initializers, Dropout, dataset shuffles).

    Re-creates the generator returned by :func:`rng`, so the same seed followed by the
    same calls gives the same numbers.

    Parameters
    ----------
    seed : int
        A non-negative int.
    """
    seed = _check_int_range("set_seed", "seed", seed, 0, None)
    _STATE.seed = seed
    _STATE.generator = _new_generator(seed)


def get_seed() -> Optional[int]:
    """Return the seed given to :func:`set_seed`, or ``None`` if it was never called."""
    return _STATE.seed


def rng() -> np.random.Generator:
    """Return the process's random generator.

    It is created from the seed of :func:`set_seed`; until a seed is set it is a
    generator seeded with 0, so an unseeded program is still deterministic.
    """
    return _STATE.generator


def derived_rng(*key: int) -> np.random.Generator:
    """Return a fresh generator that depends only on the seed and ``key``.

    Unlike :func:`rng`, its numbers do not depend on how much randomness was drawn
    before. Use it where several simulated ranks in one process (or the ranks of an MPI
    job) must draw the *same* numbers, e.g. the permutation a sharded dataset shuffles
    with. ``key`` is a tuple of non-negative ints naming the stream (e.g. ``(stream,
    epoch)``). Without a seed, the seed is taken as 0.
    """
    seed = 0 if _STATE.seed is None else _STATE.seed
    return np.random.Generator(np.random.PCG64(
        np.random.SeedSequence(entropy=seed, spawn_key=tuple(int(k) for k in key))))


# ------------------------------------------------------ auto parallel context


def _check_device_num(func: str, key: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    return _check_int_range(func, key, value, 1, _MAX_DEVICE_NUM)


def _check_pipeline_stages(func: str, key: str, value: Any) -> int:
    return _check_int_range(func, key, value, 1, _MAX_DEVICE_NUM)


_PIPELINE_SCHEDULERS = ("1f1b", "gpipe")


def _check_pipeline_config(func: str, key: str, value: Any) -> Mapping[str, Any]:
    """``{"pipeline_scheduler": "1f1b" | "gpipe", "pipeline_interleave": False}``; the
    keys not given take their defaults. Stored read-only."""
    if not isinstance(value, Mapping):
        raise _type_error(func, key, value, 'a dict such as {"pipeline_scheduler": '
                          '"1f1b"}')
    out = dict(_PIPELINE_DEFAULTS)
    for name, v in value.items():
        if name == "pipeline_scheduler":
            if not isinstance(v, str) or v not in _PIPELINE_SCHEDULERS:
                raise ValueError(f"{func}: {key}['pipeline_scheduler']={v!r} is not valid; "
                                 f"expected {_fmt_choices(_PIPELINE_SCHEDULERS)}")
        elif name == "pipeline_interleave":
            if v is not False:
                raise ValueError(f"{func}: {key}['pipeline_interleave']={v!r} is not "
                                 f"supported: dualmode does not implement interleaved "
                                 f"(virtual) pipeline stages; leave it False")
        else:
            raise ValueError(f"{func}: {key} has unknown key {name!r}; valid keys are "
                             f"'pipeline_scheduler' and 'pipeline_interleave'")
        out[name] = v
    return types.MappingProxyType(out)


def _check_global_rank(func: str, key: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    return _check_int_range(func, key, value, 0, _MAX_DEVICE_NUM - 1)


def _check_dataset_strategy(func: str, key: str, value: Any):
    expected = (f"{_fmt_choices(_DATASET_STRATEGY_NAMES)}, or a non-empty tuple of "
                "non-empty tuples of ints >= 1, e.g. ((1, 1, 2, 4),)")
    if isinstance(value, str):
        if value not in _DATASET_STRATEGY_NAMES:
            raise _value_error(func, key, value, expected)
        return value
    if not isinstance(value, (tuple, list)):
        raise _type_error(func, key, value, expected)
    if len(value) == 0:
        raise _value_error(func, key, value, expected)
    for i, strategy in enumerate(value):
        if not isinstance(strategy, (tuple, list)):
            raise _type_error(func, f"{key}[{i}]", strategy, "a non-empty tuple of ints >= 1")
        if len(strategy) == 0:
            raise _value_error(func, f"{key}[{i}]", strategy, "a non-empty tuple of ints >= 1")
        for j, dim in enumerate(strategy):
            if not _is_int(dim):
                raise _type_error(func, f"{key}[{i}][{j}]", dim, "an int >= 1")
            if dim < 1:
                raise _value_error(func, f"{key}[{i}][{j}]", dim, "an int >= 1")
    return tuple(tuple(int(d) for d in s) for s in value)


def _check_fusion_config(func: str, key: str, value: Any) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    return _check_increasing_positive_ints(func, key, value)


def _check_comm_fusion(func: str, key: str, value: Any) -> Dict[str, Tuple[str, Any]]:
    expected = ('a dict like {"allreduce": {"mode": "size", "config": 32}} with keys among '
                + ", ".join(repr(o) for o in ("openstate",) + _COMM_FUSION_OPS))
    if not isinstance(value, Mapping):
        raise _type_error(func, key, value, expected)
    out: Dict[str, Any] = {}
    for op, spec in value.items():
        if op == "openstate":        # MindSpore's switch: False turns every fusion off
            out[op] = _check_bool(func, f"{key}['openstate']", spec)
            continue
        if op not in _COMM_FUSION_OPS:
            raise ValueError(f"{func}: {key} has unknown key {op!r}; expected keys among "
                             + ", ".join(repr(o) for o in ("openstate",) + _COMM_FUSION_OPS))
        where = f"{key}[{op!r}]"
        if not isinstance(spec, Mapping):
            raise _type_error(func, where, spec, 'a dict {"mode": ..., "config": ...}')
        extra = set(spec) - {"mode", "config"}
        if extra:
            raise ValueError(f"{func}: {where} has unknown key {sorted(extra)[0]!r}; "
                             "expected keys 'mode' and 'config'")
        if "mode" not in spec:
            raise ValueError(f"{func}: {where}={dict(spec)!r} has no 'mode'; expected "
                             + _fmt_choices(_COMM_FUSION_MODES[op]))
        mode = _check_choice(func, f"{where}['mode']", spec["mode"], _COMM_FUSION_MODES[op])
        config = spec.get("config")
        cwhere = f"{where}['config']"
        if mode == "auto":
            if config is not None:
                raise _value_error(func, cwhere, config, "None with mode 'auto' (64 MB buckets)")
        elif mode == "size":
            size_expected = "a positive number of MB with mode 'size'"
            if not isinstance(config, numbers.Real) or _is_bool(config):
                raise _type_error(func, cwhere, config, size_expected)
            if not 0 < config < float("inf"):
                raise _value_error(func, cwhere, config, size_expected)
        else:
            config = list(_check_increasing_positive_ints(func, cwhere, config))
        out[op] = (mode, config)
    return out


def _unsupported(default: Any, what: str) -> Callable[[str, str, Any], Any]:
    """A checker for a MindSpore key dualmode does not implement: its default value is
    accepted (scripts often set it explicitly), any other is refused by name."""

    def check(func: str, key: str, value: Any) -> Any:
        if value == default and type(value) is type(default):
            return value
        raise ValueError(f"{func}: {key}={value!r} is not supported: dualmode does not "
                         f"implement {what}; leave {key} at its default {default!r}")

    return check


#: parallel_optimizer_config's keys: (default, what a value must be)
PARALLEL_OPTIMIZER_KEYS = {
    "parallel_optimizer_threshold": (64, "an int >= 0 (KB: smaller parameters are not "
                                         "sharded)"),
    "optimizer_weight_shard_size": (-1, "-1 (every data-parallel replica) or an int > 1 "
                                        "dividing the data-parallel size"),
    "gradient_accumulation_shard": (False, "False (gradient accumulation is not sharded)"),
}


def _check_parallel_optimizer_config(func: str, key: str, value: Any) -> Dict[str, Any]:
    expected = ("a dict with keys among " + ", ".join(repr(k) for k in PARALLEL_OPTIMIZER_KEYS)
                + ', e.g. {"parallel_optimizer_threshold": 64, '
                  '"optimizer_weight_shard_size": 2}')
    if not isinstance(value, Mapping):
        raise _type_error(func, key, value, expected)
    out: Dict[str, Any] = {}
    for name, v in value.items():
        if name not in PARALLEL_OPTIMIZER_KEYS:
            raise ValueError(f"{func}: {key} has unknown key {name!r}; valid keys are "
                             + ", ".join(PARALLEL_OPTIMIZER_KEYS))
        out[name] = _check_parallel_optimizer_value(func, f"{key}[{name!r}]", name, v)
    return out


def _check_parallel_optimizer_value(func: str, where: str, name: str, v: Any) -> Any:
    what = PARALLEL_OPTIMIZER_KEYS[name][1]
    if name == "gradient_accumulation_shard":
        if _check_bool(func, where, v):
            raise ValueError(f"{func}: {where}=True is not supported: dualmode does not "
                             f"shard accumulated gradients; leave it False")
        return v
    if not _is_int(v):
        raise _type_error(func, where, v, what)
    if name == "parallel_optimizer_threshold" and v < 0 or \
            name == "optimizer_weight_shard_size" and v != -1 and v < 2:
        raise _value_error(func, where, v, what)
    return int(v)


def _check_shard_size_key(func: str, key: str, value: Any) -> int:
    """MindSpore's older, top-level place of parallel_optimizer_config's
    optimizer_weight_shard_size (the same setting)."""
    return _check_parallel_optimizer_value(func, key, "optimizer_weight_shard_size", value)


def _check_parallel_optimizer_fits(func: str, cfg: "AutoParallelConfig") -> None:
    """optimizer_weight_shard_size must divide the number of devices (the data-parallel
    size when every device holds a replica); the parallel optimizer needs a mode whose
    weights are global tensors."""
    size = cfg.parallel_optimizer_config.get("optimizer_weight_shard_size", -1)
    n = cfg.device_num if cfg.device_num is not None else _backend_device_num()
    if size != -1 and n > 1 and n % size:
        valid = [-1] + [d for d in range(2, n + 1) if n % d == 0]
        raise ValueError(
            f"{func}: parallel_optimizer_config['optimizer_weight_shard_size']={size} does "
            f"not divide the {n} devices (the data-parallel size of a replicated weight); "
            f"valid values: {valid}")
    if cfg.enable_parallel_optimizer and cfg.parallel_mode == ParallelMode.HYBRID_PARALLEL:
        raise ValueError(
            f"{func}: enable_parallel_optimizer=True is not supported with "
            f"parallel_mode='hybrid_parallel' (its weights are per-device slices); use "
            f"data_parallel, semi_auto_parallel or auto_parallel")


#: strategy_ckpt_config's keys and the config fields they set
_STRATEGY_CKPT_KEYS = {"save_file": "strategy_ckpt_save_file",
                       "load_file": "strategy_ckpt_load_file",
                       "only_trainable_params": "strategy_ckpt_only_trainable_params"}


def _check_strategy_ckpt_config(func: str, key: str, value: Any) -> Dict[str, Any]:
    """MindSpore's newer form of the strategy file keys: {"save_file": path, "load_file":
    path, "only_trainable_params": bool}; only the keys given change."""
    if not isinstance(value, Mapping):
        raise _type_error(func, key, value, 'a dict with keys among "save_file", '
                          '"load_file", "only_trainable_params"')
    out: Dict[str, Any] = {}
    for name, v in value.items():
        if name not in _STRATEGY_CKPT_KEYS:
            raise ValueError(f"{func}: {key} has unknown key {name!r}; valid keys are "
                             + ", ".join(repr(k) for k in _STRATEGY_CKPT_KEYS))
        where = f"{key}[{name!r}]"
        out[name] = _check_bool(func, where, v) if name == "only_trainable_params" \
            else _check_path(func, where, v)
    return out


#: MindSpore keys dualmode knows but does not implement (default value accepted only)
_UNSUPPORTED_AUTO_PARALLEL = {
    "auto_pipeline": (False, "pipeline parallelism"),
    "gradient_fp32_sync": (True, "fp16 gradient AllReduce"),
    "loss_repeated_mean": (True, "loss_repeated_mean=False"),
}

_AUTO_PARALLEL_CHECKERS: Dict[str, Callable[[str, str, Any], Any]] = {
    "parallel_mode": lambda f, k, v: _check_choice(f, k, v, ParallelMode.MODE_LIST),
    "device_num": _check_device_num,
    "global_rank": _check_global_rank,
    "gradients_mean": _check_bool,
    "parameter_broadcast": _check_bool,
    "search_mode": lambda f, k, v: _check_choice(f, k, v, _SEARCH_MODES),
    # MindSpore's older spellings of search_mode
    "auto_parallel_search_mode": lambda f, k, v: _check_choice(f, k, v, _SEARCH_MODES),
    "sharding_propagation": _check_bool,
    "full_batch": _check_bool,
    "dataset_strategy": _check_dataset_strategy,
    "all_reduce_fusion_config": _check_fusion_config,
    "comm_fusion": _check_comm_fusion,
    "strategy_ckpt_save_file": _check_path,
    "strategy_ckpt_load_file": _check_path,
    "strategy_ckpt_config": _check_strategy_ckpt_config,
    "group_ckpt_save_file": _check_path,
    "enable_alltoall": _check_bool,
    "enable_parallel_optimizer": _check_bool,
    "parallel_optimizer_config": _check_parallel_optimizer_config,
    "optimizer_weight_shard_size": _check_shard_size_key,
}
_AUTO_PARALLEL_CHECKERS.update({k: _unsupported(d, what)
                                for k, (d, what) in _UNSUPPORTED_AUTO_PARALLEL.items()})
_AUTO_PARALLEL_CHECKERS.update({"pipeline_stages": _check_pipeline_stages,
                                "pipeline_config": _check_pipeline_config})


def _merge_auto_parallel(func: str, values: Dict[str, Any]) -> AutoParallelConfig:
    """Apply checked ``values`` to a copy of the current config and check cross-key rules."""
    cur = _STATE.auto_parallel
    updates = dict(values)
    if "full_batch" in updates:
        full_batch = updates.pop("full_batch")
        strategy = updates.get("dataset_strategy")
        if strategy is not None and (strategy == "full_batch") != full_batch:
            raise ValueError(
                f"{func}: full_batch={full_batch!r} contradicts dataset_strategy={strategy!r}; "
                "full_batch=True means dataset_strategy='full_batch'; give only one of them")
        if full_batch:
            updates["dataset_strategy"] = "full_batch"
        elif strategy is None and cur.dataset_strategy == "full_batch":
            updates["dataset_strategy"] = "data_parallel"
    for key in _UNSUPPORTED_AUTO_PARALLEL:
        if key not in ("pipeline_stages",):
            updates.pop(key, None)            # their default: nothing to store
    if "strategy_ckpt_config" in updates:
        for name, value in updates.pop("strategy_ckpt_config").items():
            field_name = _STRATEGY_CKPT_KEYS[name]
            if field_name in updates and updates[field_name] != value:
                raise ValueError(
                    f"{func}: strategy_ckpt_config[{name!r}]={value!r} contradicts "
                    f"{field_name}={updates[field_name]!r}; they are one setting (the "
                    f"second is its older form): give only one of them")
            updates[field_name] = value
    if "auto_parallel_search_mode" in updates:
        old_name = updates.pop("auto_parallel_search_mode")
        if updates.get("search_mode", old_name) != old_name:
            raise ValueError(
                f"{func}: auto_parallel_search_mode={old_name!r} contradicts "
                f"search_mode={updates['search_mode']!r}; they are one setting (the first "
                f"is its older name): give only one of them")
        updates["search_mode"] = old_name
    if "sharding_propagation" in updates:
        on = updates.pop("sharding_propagation")
        mode = updates.get("search_mode", cur.search_mode)
        if "search_mode" in updates and (mode == "sharding_propagation") != on:
            raise ValueError(
                f"{func}: sharding_propagation={on!r} contradicts search_mode={mode!r}; "
                f"sharding_propagation=True is search_mode='sharding_propagation': give "
                f"only one of them")
        if on:
            updates["search_mode"] = "sharding_propagation"
        elif mode == "sharding_propagation":    # MindSpore's search without it
            updates["search_mode"] = "dynamic_programming"
    if "comm_fusion" in updates:
        fusion = dict(updates["comm_fusion"])
        if fusion.pop("openstate", True):
            merged = dict(cur.comm_fusion)
            merged.update(fusion)
        else:                              # openstate False: no fusion of any collective
            merged = {}
            updates["all_reduce_fusion_config"] = None
        updates["comm_fusion"] = merged
    if "optimizer_weight_shard_size" in updates:
        size = updates.pop("optimizer_weight_shard_size")
        given = updates.get("parallel_optimizer_config", {})
        if given.get("optimizer_weight_shard_size", size) != size:
            raise ValueError(
                f"{func}: optimizer_weight_shard_size={size!r} contradicts "
                f"parallel_optimizer_config['optimizer_weight_shard_size']="
                f"{given['optimizer_weight_shard_size']!r}; they are one setting (the first "
                f"is its older place): give only one of them")
        updates["parallel_optimizer_config"] = dict(given, optimizer_weight_shard_size=size)
    if "parallel_optimizer_config" in updates:
        merged = dict(cur.parallel_optimizer_config)
        merged.update(updates["parallel_optimizer_config"])
        updates["parallel_optimizer_config"] = merged
    new = dataclasses.replace(cur, **updates)
    _check_parallel_optimizer_fits(func, new)
    if new.device_num is not None and new.global_rank is not None \
            and new.global_rank >= new.device_num:
        raise ValueError(
            f"{func}: global_rank={new.global_rank} is out of range for "
            f"device_num={new.device_num}; expected 0 <= global_rank < {new.device_num}")
    return new


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Configure parallel training (every key is described below).

    Parameters
    ----------
    parallel_mode : str
        ``"stand_alone"`` (default), ``"data_parallel"``, ``"semi_auto_parallel"``,
        ``"auto_parallel"`` or ``"hybrid_parallel"``.
    device_num : int or None
        Number of devices, in ``[1, 4096]``; ``None`` (default) takes it from the backend.
    global_rank : int or None
        This process's rank, ``0 <= global_rank < device_num``; ``None`` (default) takes
        it from the backend.
    gradients_mean : bool
        All-reduce data-parallel gradients with mean (True) or sum (False, default)
        where each device has a loss of its own (data_parallel, hybrid_parallel); in
        semi_auto_parallel / auto_parallel the program is written for the global batch
        and the update equals the single device's either way.
    parameter_broadcast : bool
        Broadcast rank 0's data-parallel parameters before training (default False).
    search_mode : str
        ``"sharding_propagation"`` (default), ``"dynamic_programming"`` or
        ``"recursive_programming"``. ``auto_parallel_search_mode`` is its older name, and
        ``sharding_propagation=True`` (False) an older form of ``"sharding_propagation"``
        (``"dynamic_programming"``).
    full_batch : bool
        True is the same as ``dataset_strategy="full_batch"``; False turns a
        ``"full_batch"`` strategy back into ``"data_parallel"``.
    dataset_strategy : str or tuple
        ``"data_parallel"`` (default), ``"full_batch"``, or one strategy per input, e.g.
        ``((1, 1, 2, 4),)``.
    all_reduce_fusion_config : list of int or None
        Strictly increasing gradient indices where a new fused AllReduce starts.
    comm_fusion : dict
        ``{"allreduce"|"allgather"|"reducescatter": {"mode": m, "config": c}}`` with
        ``m="auto"`` (``c=None``, 64 MB buckets), ``"size"`` (``c`` MB) or ``"index"``
        (``c`` a list of indices; AllReduce only, as in MindSpore). Merged per op with
        the earlier setting. ``"openstate": False`` turns every fusion off (the
        ``comm_fusion`` entries and ``all_reduce_fusion_config``); ``True`` changes
        nothing.
    strategy_ckpt_save_file, strategy_ckpt_load_file : str or None
        Paths of the strategy checkpoint.
    strategy_ckpt_config : dict
        MindSpore's newer form of the two keys above: ``{"save_file": path, "load_file":
        path, "only_trainable_params": bool}`` (only the keys given change; the same file
        either way). ``only_trainable_params`` (default True) saves and loads the
        layouts of trainable parameters only. A value contradicting
        ``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file`` in the same call is an
        error.
    group_ckpt_save_file : str or None
        A JSON file listing the communication groups (rank lists) of the collectives run
        since the key was set, rewritten when a new group appears.
    enable_alltoall : bool
        True (dualmode's default): redistributions may move a split from one dim to
        another with one AlltoAll where that is cheapest. False: as MindSpore's default,
        an AllGather then a local slice instead of every AlltoAll.
    enable_parallel_optimizer : bool
        The parallel optimizer (default False), in data_parallel, semi_auto_parallel and
        auto_parallel: each weight replicated over some devices (and of at least
        ``parallel_optimizer_threshold`` KB, its first dim divisible by the shard count)
        has its optimizer states and update split over those devices: its gradient is
        ReduceScattered to them, each updates its slice, the slices are AllGathered.
    parallel_optimizer_config : dict
        ``{"parallel_optimizer_threshold": KB (default 64), "optimizer_weight_shard_size":
        n (default -1: every replica; n > 1 must divide the number of devices)}``, merged
        with the earlier setting; ``"gradient_accumulation_shard"`` accepts False only.
        ``optimizer_weight_shard_size=n`` at the top level is MindSpore's older place of
        the same setting.
    auto_pipeline, gradient_fp32_sync, loss_repeated_mean : default only
        MindSpore keys dualmode does not implement (automatic stage assignment, fp16
        gradient AllReduce, ``loss_repeated_mean=False``): their default value
        (``False``, ``True``, ``True``) is accepted, any other raises ValueError naming
        the key; never silently ignored.

    Raises
    ------
    ValueError
        An unknown key (the message lists the supported ones), a value outside the valid
        set, a non-default value of a key dualmode does not implement, or inconsistent
        keys (e.g. ``global_rank >= device_num``); nothing is changed.
    TypeError
        A value of the wrong type; nothing is changed.
    """
    func = "set_auto_parallel_context"
    values = _validate(func, kwargs, _AUTO_PARALLEL_CHECKERS)
    new = _merge_auto_parallel(func, values)
    for hook in _AUTO_PARALLEL_HOOKS:
        hook(new)
    _STATE.auto_parallel = new


def _process_backend():
    """The live backend when it is one device per process ("mpi"), else None: a "sim"
    backend follows ``device_num`` rather than defining it."""
    b = _STATE.comm.backend
    b = getattr(b, "world", None) or b        # a pipeline stage's: the whole job's
    return b if b is not None and len(b.local_ranks) == 1 and b.world_size > 1 else None


def _backend_device_num() -> int:
    """Device count when ``device_num`` was not set: the MPI world size, else 1."""
    b = _process_backend()
    return 1 if b is None else b.world_size


def _backend_global_rank() -> int:
    """This process's rank when ``global_rank`` was not set: its MPI rank, else 0."""
    b = _process_backend()
    return 0 if b is None else b.local_ranks[0]


def get_auto_parallel_context(key: str) -> Any:
    """Return the value of one :func:`set_auto_parallel_context` key.

    ``device_num`` and ``global_rank`` come from the backend when they were not set.
    Lists and dicts are returned as copies.
    """
    _check_key("get_auto_parallel_context", key, _AUTO_PARALLEL_CHECKERS)
    cfg = _STATE.auto_parallel
    if key == "device_num":
        return _backend_device_num() if cfg.device_num is None else cfg.device_num
    if key == "global_rank":
        return _backend_global_rank() if cfg.global_rank is None else cfg.global_rank
    if key == "full_batch":
        return cfg.dataset_strategy == "full_batch"
    if key == "auto_parallel_search_mode":
        return cfg.search_mode
    if key == "sharding_propagation":
        return cfg.search_mode == "sharding_propagation"
    if key == "all_reduce_fusion_config":
        return None if cfg.all_reduce_fusion_config is None else list(cfg.all_reduce_fusion_config)
    if key == "comm_fusion":
        return {op: {"mode": mode, "config": copy.deepcopy(config)}
                for op, (mode, config) in cfg.comm_fusion.items()}
    if key == "pipeline_config":
        return dict(cfg.pipeline_config)
    if key == "strategy_ckpt_config":
        return {name: getattr(cfg, f) for name, f in _STRATEGY_CKPT_KEYS.items()}
    if key == "parallel_optimizer_config":
        return dict(cfg.parallel_optimizer_config)
    if key == "optimizer_weight_shard_size":
        return cfg.parallel_optimizer_config.get(key, -1)
    if not hasattr(cfg, key):
        return copy.deepcopy(_UNSUPPORTED_AUTO_PARALLEL[key][0])
    return getattr(cfg, key)


def reset_auto_parallel_context() -> None:
    """Restore every :func:`set_auto_parallel_context` key to its default."""
    _STATE.auto_parallel = AutoParallelConfig()
    _leave_pipeline_stage()


# -------------------------------------------------------------- algo parameters


_ALGO_CHECKERS: Dict[str, Callable[[str, str, Any], Any]] = {
    "fully_use_devices": _check_bool,
}


def set_algo_parameters(**kwargs: Any) -> None:
    """Set parameters of the strategy search.

    Parameters
    ----------
    fully_use_devices : bool
        Only consider strategies that use every device (default True).

    Raises
    ------
    ValueError, TypeError
        As :func:`set_auto_parallel_context`; nothing is changed.
    """
    values = _validate("set_algo_parameters", kwargs, _ALGO_CHECKERS)
    _STATE.algo = dataclasses.replace(_STATE.algo, **values)


def get_algo_parameters(key: str) -> Any:
    """Return the value of one :func:`set_algo_parameters` key."""
    _check_key("get_algo_parameters", key, _ALGO_CHECKERS)
    return getattr(_STATE.algo, key)


def reset_algo_parameters() -> None:
    """Restore every :func:`set_algo_parameters` key to its default."""
    _STATE.algo = AlgoParameters()


# ------------------------------------------------------------ parameter server


_PS_MODES = ("sync", "async")


def _check_positive_seconds(func: str, key: str, value: Any) -> float:
    expected = "a finite number of seconds > 0"
    if not isinstance(value, numbers.Real) or _is_bool(value):
        raise _type_error(func, key, value, expected)
    if not 0 < value < float("inf"):
        raise _value_error(func, key, value, expected)
    return float(value)


def _check_staleness(func: str, key: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    return _check_int_range(func, key, value, 0, None)


_PS_CHECKERS: Dict[str, Callable[[str, str, Any], Any]] = {
    "enable_ps": _check_bool,
    "mode": lambda f, k, v: _check_choice(f, k, v, _PS_MODES),
    "staleness": _check_staleness,
    "heartbeat_interval": _check_positive_seconds,
    "heartbeat_timeout": _check_positive_seconds,
    "connect_timeout": _check_positive_seconds,
    "recovery_interval": lambda f, k, v: _check_int_range(f, k, v, 1, None),
}


def set_ps_context(**kwargs: Any) -> None:
    """Configure parameter server mode (MindSpore's ``set_ps_context``); call it before
    ``communication.init()``.

    Parameters
    ----------
    enable_ps : bool
        Turn parameter server mode on: ``init()`` then reads this process's role from
        ``DM_ROLE`` / ``MS_ROLE`` and joins the cluster (see ``docs/parameter_server.md``).
    mode : str
        ``"sync"`` (default: each step applies the mean of every live worker's gradient)
        or ``"async"`` (each push is applied on arrival).
    staleness : int or None
        async only: a gradient computed on weights more than ``staleness`` updates old is
        not applied (the worker gets the current weights). None (default): no bound.
    heartbeat_interval, heartbeat_timeout : float
        Seconds between heartbeats (default 1) and without one before a node is taken as
        dead (default 10; must exceed the interval).
    connect_timeout : float
        Seconds to wait for the scheduler, the whole cluster, or a server's answer
        before giving up with an error naming the address (default 60).
    recovery_interval : int
        With ``DM_RECOVERY_PATH`` set, servers checkpoint after every this many applied
        steps (default 1); workers keep the gradients since the last checkpoint and push
        them again to a restarted server.

    Raises
    ------
    ValueError, TypeError
        As :func:`set_auto_parallel_context`; nothing is changed.
    """
    func = "set_ps_context"
    values = _validate(func, kwargs, _PS_CHECKERS)
    new = dataclasses.replace(_STATE.ps, **values)
    if new.heartbeat_timeout <= new.heartbeat_interval:
        raise ValueError(f"{func}: heartbeat_timeout={new.heartbeat_timeout} must exceed "
                         f"heartbeat_interval={new.heartbeat_interval}")
    if new.staleness is not None and new.mode != "async":
        raise ValueError(f"{func}: staleness={new.staleness} needs mode='async'; sync "
                         "training has no stale gradients")
    _STATE.ps = new


def get_ps_context(key: str) -> Any:
    """Return the value of one :func:`set_ps_context` key."""
    _check_key("get_ps_context", key, _PS_CHECKERS)
    return getattr(_STATE.ps, key)


def reset_ps_context() -> None:
    """Restore every :func:`set_ps_context` key to its default (parameter server off)."""
    _STATE.ps = PSConfig()
