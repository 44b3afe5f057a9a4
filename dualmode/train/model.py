"""``Model``: the high-level train / eval / predict loop (as ``mindspore.train.Model``)."""
from __future__ import annotations

import numbers
import sys
from types import SimpleNamespace

from .. import context
from ..autograd import value_and_grad
from ..nn import Cell
from ..parallel.devices import parallel_active
from ..parallel.grad_reduce import broadcast_parameters
from .callback import CallbackList, RunContext
from .metrics import Metric, get_metric

__all__ = ["Model"]


def _is_cell(obj):
    return isinstance(obj, Cell)


class Model:
    """Wrap a network, a loss and an optimizer for training and evaluation.

    Parameters
    ----------
    network : nn.Cell
        The forward network. With `loss_fn`, each data row is ``(*inputs, label)`` and
        the loss is ``loss_fn(network(*inputs), label)``; without it, the network
        returns the loss from all columns.
    loss_fn : callable, optional
    optimizer : nn.Optimizer, optional
        Required by :meth:`train`.
    metrics : set/list of names ("accuracy", "loss", "mae", "mse") or dict name -> Metric
    """

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None):
        if not _is_cell(network):
            raise TypeError(f"Model: network must be a dualmode.nn.Cell, got "
                            f"{type(network).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Model: loss_fn must be callable, got {type(loss_fn).__name__}")
        if optimizer is not None and not hasattr(optimizer, "parameters"):
            raise TypeError(f"Model: optimizer must be a dualmode.nn.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self._network = network
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._metrics = self._make_metrics(metrics)
        self._train_step = None

    @staticmethod
    def _make_metrics(metrics):
        if metrics is None:
            return {}
        if isinstance(metrics, dict):
            out = {}
            for k, m in metrics.items():
                if not isinstance(m, Metric):
                    raise TypeError(f"Model: metrics[{k!r}] is a {type(m).__name__}; expected "
                                    f"a dualmode.train.Metric")
                out[k] = m
            return out
        if isinstance(metrics, (set, list, tuple)):
            return {name: get_metric(name) for name in sorted(metrics)}
        raise TypeError(f"Model: metrics must be a set/list of names or a dict of Metrics, got "
                        f"{type(metrics).__name__}")

    @property
    def train_network(self):
        return self._network

    # ---- training -------------------------------------------------------------
    def _forward_loss(self, *cols):
        if self._loss_fn is None:
            return self._network(*cols)
        if len(cols) < 2:
            raise ValueError(f"Model: with a loss_fn each data row needs inputs and a label; "
                             f"got {len(cols)} column(s)")
        return self._loss_fn(self._network(*cols[:-1]), cols[-1])

    def _build_train_step(self):
        opt = self._optimizer
        grad_fn = value_and_grad(self._forward_loss, None, opt.parameters)

        def step(*cols):
            loss, grads = grad_fn(*cols)
            opt(grads)
            return loss

        return step

    def train(self, epoch, train_dataset, callbacks=None, dataset_sink_mode=False,
              sink_size=-1, initial_epoch=0):
        """Train for `epoch` epochs over `train_dataset`, calling `callbacks` each step.

        A progress bar (tqdm) is shown when standard output is a terminal.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 1:
            raise ValueError(f"Model.train: epoch={epoch!r} must be a positive int")
        if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, numbers.Integral) \
                or not 0 <= initial_epoch < epoch:
            raise ValueError(f"Model.train: initial_epoch={initial_epoch!r} must be an int in "
                             f"[0, {epoch})")
        if self._optimizer is None:
            raise RuntimeError("Model.train: the Model has no optimizer; pass optimizer= to "
                               "Model(...)")
        if not hasattr(train_dataset, "get_dataset_size"):
            raise TypeError(f"Model.train: train_dataset must be a dualmode.dataset dataset, "
                            f"got {type(train_dataset).__name__}")
        cbs = CallbackList(callbacks)
        if self._train_step is None:
            self._train_step = self._build_train_step()
        batch_num = train_dataset.get_dataset_size()
        cb = SimpleNamespace(train_network=self._network, optimizer=self._optimizer,
                             loss_fn=self._loss_fn, epoch_num=epoch, batch_num=batch_num,
                             cur_epoch_num=initial_epoch, cur_step_num=initial_epoch * batch_num,
                             net_outputs=None, progress_bar=None, mode="train")
        ctx = RunContext(cb)
        self._network.set_train(True)
        if context.get_auto_parallel_context("parameter_broadcast") and parallel_active():
            broadcast_parameters(self._network.trainable_params())
        cbs.on_train_begin(ctx)
        use_bar = _stdout_is_terminal()
        batches = _Batches(train_dataset)
        for e in range(initial_epoch, epoch):
            cb.cur_epoch_num = e + 1
            cbs.on_train_epoch_begin(ctx)
            bar = _progress(batch_num, f"epoch {e + 1}/{epoch}") if use_bar else None
            cb.progress_bar = bar
            try:
                for cols in batches.take(batch_num):
                    cb.cur_step_num += 1
                    cbs.on_train_step_begin(ctx)
                    cb.net_outputs = self._train_step(*cols)
                    if bar is not None:
                        bar.update(1)
                    cbs.on_train_step_end(ctx)
                    if ctx.get_stop_requested():
                        break
            finally:
                if bar is not None:
                    bar.close()
                cb.progress_bar = None
            cbs.on_train_epoch_end(ctx)
            if ctx.get_stop_requested():
                break
        cbs.on_train_end(ctx)

    # ---- evaluation -------------------------------------------------------------
    def eval(self, valid_dataset, callbacks=None, dataset_sink_mode=False):
        """Evaluate the metrics over `valid_dataset`; returns ``{name: value}``."""
        if not self._metrics:
            raise RuntimeError("Model.eval: the Model has no metrics; pass metrics={'accuracy'} "
                               "(or others) to Model(...)")
        for m in self._metrics.values():
            m.clear()
        self._network.set_train(False)
        try:
            for cols in valid_dataset:
                if len(cols) < 2:
                    raise ValueError(f"Model.eval: each data row needs inputs and a label; got "
                                     f"{len(cols)} column(s)")
                logits = self._network(*cols[:-1])
                label = cols[-1]
                loss = None
                for m in self._metrics.values():
                    if type(m).__name__ == "Loss":
                        if self._loss_fn is None:
                            raise RuntimeError("Model.eval: the 'loss' metric needs a loss_fn")
                        if loss is None:
                            loss = self._loss_fn(logits, label)
                        m.update(loss)
                    else:
                        m.update(logits, label)
        finally:
            self._network.set_train(True)
        return {k: m.eval() for k, m in self._metrics.items()}

    def predict(self, *predict_data):
        """The network's output on `predict_data` (inference mode)."""
        self._network.set_train(False)
        try:
            return self._network(*predict_data)
        finally:
            self._network.set_train(True)


class _Batches:
    """Steps of an epoch: `get_dataset_size()` rows from one iterator, restarted when a
    pass ends (so a repeated or infinite dataset still gives epochs of that size)."""

    def __init__(self, dataset):
        self._dataset = dataset
        self._it = None

    def take(self, n):
        taken = 0
        restarted = False
        while taken < n:
            if self._it is None:
                self._it = iter(self._dataset)
            try:
                cols = next(self._it)
            except StopIteration:
                self._it = None
                if restarted:
                    return
                restarted = True
                continue
            restarted = False
            taken += 1
            yield cols


def _stdout_is_terminal():
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _progress(total, desc):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stdout, leave=False, dynamic_ncols=True)
