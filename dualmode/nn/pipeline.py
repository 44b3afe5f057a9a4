"""PipelineCell and MicroBatchInterleaved: a network run over micro-batches (MindSpore's
``nn.PipelineCell`` / ``nn.MicroBatchInterleaved``)."""
from __future__ import annotations

from .. import context
from .._core._tensor import recording
from ..parallel.graph.api import ShardFunction
from ..parallel.pipeline import (PLANNING, PipelinePlan, PipelineRun, Remote,
                                 active_stages, micro_batches, note_parameter_stages,
                                 stage_order, staged_cells)
from .cell import Cell

__all__ = ["PipelineCell", "MicroBatchInterleaved"]


def _check_args(owner, network, name, value):
    if not isinstance(network, Cell):
        raise TypeError(f"{owner}: network must be a Cell, got {type(network).__name__}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"{owner}: {name}={value} is not valid; expected an int >= 1")


def _stage_graph(cell, construct, name):
    """GRAPH_MODE under pipeline parallelism: the staged `cell`'s construct compiled for
    its stage's devices (cached on the cell; compiled again for each new signature of
    its inputs, e.g. another micro-batch shape)."""
    fn = cell.__dict__.get("_stage_graph_fn")
    if fn is None:
        def run(*args, **kwargs):
            return construct(cell, *args, **kwargs)
        auto = context._STATE.auto_parallel.parallel_mode == "auto_parallel"
        fn = ShardFunction(run, owner=f"{name} (pipeline stage, GRAPH_MODE)",
                           propagate=auto)
        cell.__dict__["_stage_graph_fn"] = fn
    return fn


def _add(total, out):
    if isinstance(out, Remote):      # another process computes this stage's output
        return total
    if total is None:
        return out
    if isinstance(out, tuple):
        return tuple(a + b for a, b in zip(total, out))
    return total + out


class PipelineCell(Cell):
    """Cut the batch into `micro_size` micro-batches and run `network` on each; returns
    the sum of the network's outputs over the micro-batches (as MindSpore: with a mean
    loss, `micro_size` times the mean over the batch), so the weights' gradients are
    accumulated over the micro-batches and the optimizer steps once per batch.

    Under pipeline parallelism (``set_auto_parallel_context(pipeline_stages=S)`` in
    ``semi_auto_parallel`` or ``auto_parallel``) the cells of `network` with
    ``cell.pipeline_stage = k`` run on stage ``k``'s ``device_num / S`` devices, and the
    values that pass from one stage to the next move as point-to-point transfers
    (``Send`` / ``Receive`` in ``CommReport``, reason ``"pipeline"``), forward and, for
    their gradients, backward. ``dualmode.parallel.pipeline_schedule(S, micro_size)``
    prints which stage runs which micro-batch when (1F1B or GPipe, per
    ``pipeline_config``).

    A distributed input is cut on each device (each device's rows are split into
    `micro_size` parts), a plain one into consecutive rows.

    Parameters
    ----------
    network : Cell
        The network with its loss (e.g. ``WithLossCell``).
    micro_size : int
        Micro-batches per batch (>= 1; MindSpore asks for at least ``pipeline_stages``,
        dualmode accepts fewer: the schedule then has more idle slots). It must divide
        each device's rows of the batch.
    stage_config : dict, optional
        ``{cell name: stage}``: sets ``pipeline_stage`` on the named cells of `network`
        (names as ``network.cells_and_names()`` gives them).
    """

    #: what a dry run looks for to plan the pipeline schedule of a step
    runs_pipeline = True

    @property
    def _eager_only(self):
        """Under pipeline parallelism this cell runs its micro-batches itself, also in
        GRAPH_MODE (where each stage's cells are compiled, for their stage's devices)."""
        cfg = context._STATE.auto_parallel
        return cfg.pipeline_stages > 1 and cfg.parallel_mode in ("semi_auto_parallel",
                                                                 "auto_parallel")

    def __init__(self, network, micro_size, stage_config=None):
        super().__init__(auto_prefix=False)
        owner = "PipelineCell"
        _check_args(owner, network, "micro_size", micro_size)
        if stage_config is not None:
            if not isinstance(stage_config, dict):
                raise TypeError(f"{owner}: stage_config must be a dict {{cell name: "
                                f"stage}}, got {type(stage_config).__name__}")
            cells = dict(network.cells_and_names())
            unknown = [n for n in stage_config if n not in cells or not n]
            if unknown:
                raise KeyError(f"{owner}: stage_config names {unknown[0]!r}, which is not "
                               f"a cell of the network; its cells are "
                               + ", ".join(repr(n) for n in cells if n))
            for name, stage in stage_config.items():     # each checked before any is set
                if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                    raise ValueError(f"{owner}: stage_config[{name!r}]={stage!r} is not "
                                     f"valid; expected an int >= 0")
            for name, stage in stage_config.items():
                cells[name].pipeline_stage = stage
        self.network = network
        self.micro_size = micro_size
        #: the order of the last differentiated 1F1B call: ``[("F", m), ("B", m), ...]``
        self.last_order = None
        note_parameter_stages(network)     # for the per-device memory CommReport shows

    def construct(self, *inputs):
        owner = "PipelineCell"
        if PLANNING[0] is not None:       # a dry run: one micro-batch, traced
            staged = staged_cells(self.network, PLANNING[0], owner)
            with PipelinePlan(self.network, staged, owner) as run:
                return run.output(self.network(*inputs))
        stages = active_stages(owner)
        graph = _stage_graph if context._STATE.run.mode == context.GRAPH_MODE else None
        if stages == 1:
            total = None
            for mi in micro_batches(inputs, self.micro_size, owner):
                total = _add(total, self.network(*mi))
            return total
        staged = staged_cells(self.network, stages, owner)
        scheduler = context._STATE.auto_parallel.pipeline_config["pipeline_scheduler"]
        total = None
        with PipelineRun(self.network, staged, owner, graph) as run:
            if scheduler == "1f1b" and recording():
                # each micro-batch's backward where the 1F1B order puts it: this
                # process's stage's order ("sim": the first stage's)
                order = stage_order(scheduler, stages, self.micro_size, run.here or 0)
                out, self.last_order = run.run_1f1b(self.network, inputs,
                                                    self.micro_size, order)
                return out
            for mi in micro_batches(inputs, self.micro_size, owner):
                total = _add(total, self.network(*mi))
            return run.output(total)


class MicroBatchInterleaved(Cell):
    """Cut the batch into `interleave_num` parts and run `network` on each; returns the
    sum of the outputs (MindSpore's ``nn.MicroBatchInterleaved``: on a device the parts
    let one part's communication overlap the next part's computation; the numbers are
    those of the parts run one after the other). Inputs are cut as
    :class:`PipelineCell` cuts them.

    Parameters
    ----------
    network : Cell
    interleave_num : int
        Parts per batch (default 2).
    """

    def __init__(self, network, interleave_num=2):
        super().__init__(auto_prefix=False)
        _check_args("MicroBatchInterleaved", network, "interleave_num", interleave_num)
        self.network = network
        self.interleave_num = interleave_num

    def construct(self, *inputs):
        total = None
        for part in micro_batches(inputs, self.interleave_num, "MicroBatchInterleaved"):
            total = _add(total, self.network(*part))
        return total
