"""Training callbacks: the Callback protocol, RunContext, LossMonitor."""
from __future__ import annotations

import math
import numbers
import os
import re
import time
from types import SimpleNamespace

import numpy as np

from .serialization import save_checkpoint

__all__ = ["Callback", "RunContext", "LossMonitor", "CallbackList", "TimeMonitor",
           "CheckpointConfig", "ModelCheckpoint"]


class RunContext:
    """What a callback sees: ``original_args()`` (the step's parameters) and
    ``request_stop()`` to end training after the current step."""

    def __init__(self, cb_params: SimpleNamespace):
        self._params = cb_params
        self._stop = False

    def original_args(self) -> SimpleNamespace:
        return self._params

    def request_stop(self):
        self._stop = True

    def get_stop_requested(self) -> bool:
        return self._stop


class Callback:
    """Base class: override any of the hooks (MindSpore 2.x names and the 1.x aliases)."""

    def on_train_begin(self, run_context):
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context):
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context):
        self.step_begin(run_context)

    def on_train_step_end(self, run_context):
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context):
        self.epoch_end(run_context)

    def on_train_end(self, run_context):
        self.end(run_context)

    def on_eval_begin(self, run_context):
        pass

    def on_eval_end(self, run_context):
        pass

    # MindSpore 1.x names
    def begin(self, run_context):
        pass

    def epoch_begin(self, run_context):
        pass

    def step_begin(self, run_context):
        pass

    def step_end(self, run_context):
        pass

    def epoch_end(self, run_context):
        pass

    def end(self, run_context):
        pass


class CallbackList(Callback):
    """Several callbacks run in order."""

    def __init__(self, callbacks):
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        elif not isinstance(callbacks, (list, tuple)):
            raise TypeError(f"Model.train: callbacks must be a Callback or a list of them, got "
                            f"{type(callbacks).__name__}")
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise TypeError(f"Model.train: callbacks[{i}] is a {type(cb).__name__}; "
                                f"expected a dualmode.train.Callback")
        self.callbacks = list(callbacks)

    def _each(name):
        def hook(self, run_context):
            for cb in self.callbacks:
                getattr(cb, name)(run_context)
        hook.__name__ = name
        return hook

    on_train_begin = _each("on_train_begin")
    on_train_epoch_begin = _each("on_train_epoch_begin")
    on_train_step_begin = _each("on_train_step_begin")
    on_train_step_end = _each("on_train_step_end")
    on_train_epoch_end = _each("on_train_epoch_end")
    on_train_end = _each("on_train_end")
    del _each


def _loss_value(outputs):
    """The scalar loss out of a network's outputs (Tensor, tuple, number)."""
    if isinstance(outputs, (tuple, list)) and outputs:
        outputs = outputs[0]
    if hasattr(outputs, "asnumpy"):
        outputs = outputs.asnumpy()
    arr = np.asarray(outputs)
    return float(arr.mean()) if arr.size else float("nan")


class LossMonitor(Callback):
    """Print ``epoch: E step: S, loss is L`` every `per_print_times` steps.

    Epoch and step count from 1 (the step within the epoch), as MindSpore.
    A NaN or infinite loss stops training with a ValueError.
    """

    def __init__(self, per_print_times=1):
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, numbers.Integral) \
                or per_print_times < 0:
            raise ValueError(f"LossMonitor: per_print_times={per_print_times!r} must be an int "
                             f">= 0")
        self._per_print_times = int(per_print_times)
        self.losses = []

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        loss = _loss_value(cb.net_outputs)
        step_in_epoch = (cb.cur_step_num - 1) % cb.batch_num + 1 if cb.batch_num else \
            cb.cur_step_num
        if math.isnan(loss) or math.isinf(loss):
            raise ValueError(f"epoch: {cb.cur_epoch_num} step: {step_in_epoch}. Invalid loss "
                             f"{loss}, terminating training.")
        self.losses.append(loss)
        if self._per_print_times and cb.cur_step_num % self._per_print_times == 0:
            line = f"epoch: {cb.cur_epoch_num} step: {step_in_epoch}, loss is {loss:.7g}"
            bar = getattr(cb, "progress_bar", None)
            if bar is not None:
                bar.write(line)
            else:
                print(line, flush=True)


def _positive_int(owner, name, value, allow_zero=False):
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{owner}: {name}={value!r} must be an int >= {lo}")
    return int(value)


class TimeMonitor(Callback):
    """Print ``epoch time: T ms, per step time: S ms`` at the end of every epoch
    (MindSpore's format); the per-epoch times (seconds) are kept in ``epoch_times``.

    Parameters
    ----------
    data_size : int, optional
        Steps per epoch used for the per-step time (default: the epoch's batch count).
    """

    def __init__(self, data_size=None):
        if data_size is not None:
            data_size = _positive_int("TimeMonitor", "data_size", data_size)
        self.data_size = data_size
        self.epoch_times = []
        self._start = None

    def on_train_epoch_begin(self, run_context):
        self._start = time.perf_counter()

    def on_train_epoch_end(self, run_context):
        if self._start is None:
            return
        seconds = time.perf_counter() - self._start
        self.epoch_times.append(seconds)
        cb = run_context.original_args()
        steps = self.data_size or cb.batch_num or 1
        ms = seconds * 1000.0
        print(f"epoch time: {ms:5.3f} ms, per step time: {ms / steps:5.3f} ms", flush=True)


class CheckpointConfig:
    """When and how :class:`ModelCheckpoint` saves (MindSpore's ``CheckpointConfig``).

    Parameters
    ----------
    save_checkpoint_steps : int
        Save every this many steps (counted over the whole run).
    keep_checkpoint_max : int
        Keep only the newest this many files (0: keep all).
    integrated_save : bool
        True: global values in one file; False: each rank's slices (``rank_<r>/``) and
        the strategy file, no gather.
    """

    def __init__(self, save_checkpoint_steps=1, keep_checkpoint_max=5, integrated_save=True):
        owner = "CheckpointConfig"
        self.save_checkpoint_steps = _positive_int(owner, "save_checkpoint_steps",
                                                   save_checkpoint_steps)
        self.keep_checkpoint_max = _positive_int(owner, "keep_checkpoint_max",
                                                 keep_checkpoint_max, allow_zero=True)
        if not isinstance(integrated_save, bool):
            raise TypeError(f"{owner}: integrated_save must be a bool, got "
                            f"{integrated_save!r}")
        self.integrated_save = integrated_save

    def __repr__(self):
        return (f"CheckpointConfig(save_checkpoint_steps={self.save_checkpoint_steps}, "
                f"keep_checkpoint_max={self.keep_checkpoint_max}, "
                f"integrated_save={self.integrated_save})")


class ModelCheckpoint(Callback):
    """Save the network and its optimizer (states and step) every
    ``config.save_checkpoint_steps`` steps as ``<directory>/<prefix>-<epoch>_<step>.safetensors``
    (step within the epoch, as MindSpore), keeping the newest
    ``config.keep_checkpoint_max`` files. ``latest`` is the path of the last save.
    """

    def __init__(self, prefix="CKP", directory=None, config=None):
        owner = "ModelCheckpoint"
        if not isinstance(prefix, str) or not prefix or os.sep in prefix:
            raise ValueError(f"{owner}: prefix={prefix!r} must be a non-empty file name "
                             f"prefix without {os.sep!r}")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"{owner}: directory must be a path (str) or None, got "
                            f"{type(directory).__name__}")
        if config is None:
            config = CheckpointConfig()
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"{owner}: config must be a CheckpointConfig, got "
                            f"{type(config).__name__}")
        self.prefix = prefix
        self.directory = os.fspath(directory) if directory is not None else os.getcwd()
        self.config = config
        self.latest = None
        self._saved = []

    def on_train_begin(self, run_context):
        os.makedirs(self.directory, exist_ok=True)

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        if cb.cur_step_num % self.config.save_checkpoint_steps:
            return
        step = (cb.cur_step_num - 1) % cb.batch_num + 1 if cb.batch_num else cb.cur_step_num
        path = os.path.join(self.directory,
                            f"{self.prefix}-{cb.cur_epoch_num}_{step}.safetensors")
        cells = [c for c in (cb.train_network, cb.optimizer) if c is not None]
        save_checkpoint(cells, path, integrated_save=self.config.integrated_save,
                        append_dict={"epoch_num": cb.cur_epoch_num,
                                     "step_num": cb.cur_step_num})
        self.latest = path
        if path in self._saved:
            self._saved.remove(path)
        self._saved.append(path)
        self._prune()

    def _prune(self):
        keep = self.config.keep_checkpoint_max
        if not keep:
            return
        while len(self._saved) > keep:
            old = self._saved.pop(0)
            targets = [old] if self.config.integrated_save else \
                [os.path.join(d, os.path.basename(old)) for d in self._rank_dirs()]
            for t in targets:
                try:
                    os.remove(t)
                except FileNotFoundError:
                    pass

    def _rank_dirs(self):
        pattern = re.compile(r"^rank_\d+$")
        return [os.path.join(self.directory, d) for d in os.listdir(self.directory)
                if pattern.match(d) and os.path.isdir(os.path.join(self.directory, d))]
