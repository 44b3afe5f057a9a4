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
from ..parallel.tensor_layout import TensorLayout
from .amp import FixedLossScaleManager, apply_amp, check_amp_level, grads_finite, to_float32
from .callback import CallbackList, RunContext
from .layouts import (apply_context_strategy, network_parameters, parameter_layouts,
                      save_context_strategy)
from .metrics import Metric, get_metric
from .strategy_file import layout_entry

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
    amp_level : "O0" (default) or "O2"
        "O2": Dense and Conv2d compute in float16 from float32 master weights, BatchNorm
        in float32, the loss in float32 with a static loss scale (see
        :mod:`dualmode.train.amp`).
    loss_scale_manager : FixedLossScaleManager, optional
        The loss scale under "O2" (default ``FixedLossScaleManager(128.0)``).
    """

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None, amp_level="O0",
                 loss_scale_manager=None):
        if not _is_cell(network):
            raise TypeError(f"Model: network must be a dualmode.nn.Cell, got "
                            f"{type(network).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Model: loss_fn must be callable, got {type(loss_fn).__name__}")
        if optimizer is not None and not hasattr(optimizer, "parameters"):
            raise TypeError(f"Model: optimizer must be a dualmode.nn.Optimizer, got "
                            f"{type(optimizer).__name__}")
        check_amp_level(amp_level)
        if loss_scale_manager is not None and \
                not isinstance(loss_scale_manager, FixedLossScaleManager):
            raise TypeError(f"Model: loss_scale_manager must be a FixedLossScaleManager, got "
                            f"{type(loss_scale_manager).__name__}")
        if amp_level == "O2" and loss_scale_manager is None:
            loss_scale_manager = FixedLossScaleManager()
        self._amp_level = amp_level
        self._loss_scale = loss_scale_manager
        apply_amp(network, amp_level)
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
            return to_float32(self._network(*cols))
        if len(cols) < 2:
            raise ValueError(f"Model: with a loss_fn each data row needs inputs and a label; "
                             f"got {len(cols)} column(s)")
        return self._loss_fn(to_float32(self._network(*cols[:-1])), cols[-1])

    def _build_train_step(self):
        opt = self._optimizer
        if self._loss_scale is None:
            grad_fn = value_and_grad(self._forward_loss, None, opt.parameters)

            def step(*cols):
                loss, grads = grad_fn(*cols)
                opt(grads)
                return loss

            return step
        scale = self._loss_scale.get_loss_scale()
        drop = self._loss_scale.drop_overflow_update
        grad_fn = value_and_grad(lambda *cols: self._forward_loss(*cols) * scale, None,
                                 opt.parameters)

        def scaled_step(*cols):
            scaled, grads = grad_fn(*cols)
            grads = tuple(g / scale for g in grads)
            if not drop or grads_finite(grads):      # an overflowed step is skipped
                opt(grads)
            return scaled / scale

        return scaled_step

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
        apply_context_strategy(self._parameters(), "Model.train")
        strategy_saved = False
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
                    with _StepErrors(cb):
                        cbs.on_train_step_begin(ctx)
                        cb.net_outputs = self._train_step(*cols)
                        if not strategy_saved:          # layouts are fixed by the first step
                            strategy_saved = True
                            self._save_strategy()
                        if bar is not None:
                            bar.update(1)
                        cbs.on_train_step_end(ctx)
                    if ctx.get_stop_requested():
                        break
            finally:
                if bar is not None:
                    bar.close()
                cb.progress_bar = None
            with _StepErrors(cb):
                cbs.on_train_epoch_end(ctx)
            if ctx.get_stop_requested():
                break
        cbs.on_train_end(ctx)

    def _parameters(self):
        return network_parameters(self._network, self._optimizer)

    def _save_strategy(self):
        params = self._parameters()
        layouts = {p.name: p._layout for p in params if isinstance(p._layout, TensorLayout)}
        save_context_strategy(layouts, {p.name: p.dtype for p in params})

    # ---- layouts ------------------------------------------------------------------
    def _infer(self, fn, args, owner):
        apply_context_strategy(self._parameters(), owner)
        layouts = parameter_layouts(fn, args, self._parameters(), owner)
        save_context_strategy({k: v for k, v in layouts.items() if any(v.tensor_map)})
        return {name: layout_entry(lay) for name, lay in layouts.items()}

    def infer_predict_layout(self, *predict_data):
        """The layout of every parameter when the network runs on `predict_data`,
        ``{name: [device_matrix, tensor_map, slice_shape, 0, True, ""]}`` (MindSpore's
        form; see ``dualmode.train.strategy_file``), found by compiling the network
        without running it: no weight changes. Feed it to
        ``load_distributed_checkpoint(..., predict_strategy=...)``."""
        if not predict_data:
            raise ValueError("Model.infer_predict_layout: give the network's inputs "
                             "(predict_data), e.g. model.infer_predict_layout(Tensor(x))")
        net = self._network
        return self._infer(lambda *xs: net.call_construct(*xs), predict_data,
                           "Model.infer_predict_layout")

    def infer_train_layout(self, train_dataset, dataset_sink_mode=True, sink_size=-1):
        """The layout of every parameter (and optimizer state) in training on
        `train_dataset`'s batches, found by compiling the loss on its first batch
        without running a step: no weight changes. Same form as
        :meth:`infer_predict_layout`."""
        if not hasattr(train_dataset, "get_dataset_size"):
            raise TypeError(f"Model.infer_train_layout: train_dataset must be a "
                            f"dualmode.dataset dataset, got {type(train_dataset).__name__}")
        first = next(iter(_Batches(train_dataset).take(1)), None)
        if first is None:
            raise ValueError("Model.infer_train_layout: train_dataset is empty")
        net, loss_fn = self._network, self._loss_fn
        if loss_fn is None:
            def fn(*cols):
                return net.call_construct(*cols)
        else:
            if len(first) < 2:
                raise ValueError(f"Model.infer_train_layout: with a loss_fn each data row needs "
                                 f"inputs and a label; got {len(first)} column(s)")

            def fn(*cols):
                return loss_fn(net.call_construct(*cols[:-1]), cols[-1])
        layouts = self._infer(fn, tuple(first), "Model.infer_train_layout")
        if self._optimizer is not None:            # states share their weight's layout
            for prefix in self._optimizer.__dict__.get("_state_names", ()):
                for p, st in zip(self._optimizer.parameters, getattr(self._optimizer, prefix)):
                    if p.name in layouts:
                        layouts[st.name] = layouts[p.name]
        return layouts

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


class _StepErrors:
    """Re-raise an error of a training step with the epoch and step it happened in."""

    def __init__(self, cb):
        self.cb = cb

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or not isinstance(err, Exception) or \
                getattr(err, "_dm_step_named", False):
            return False
        cb = self.cb
        step = (cb.cur_step_num - 1) % cb.batch_num + 1 if cb.batch_num else cb.cur_step_num
        where = f"epoch: {cb.cur_epoch_num} step: {step}"
        msg = str(err)
        if where not in msg:
            msg = f"Model.train: error in {where}: {msg}"
        try:
            new = type(err)(msg)
        except Exception:                    # an exception type that takes other arguments
            new = RuntimeError(f"{type(err).__name__}: {msg}")
        new._dm_step_named = True
        raise new.with_traceback(tb) from err


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
