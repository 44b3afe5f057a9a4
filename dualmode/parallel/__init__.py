"""dualmode.parallel: layouts, distributed tensors, gradient reduction, reports."""
from ..context import get_algo_parameters, reset_algo_parameters, set_algo_parameters
from ._layout_checks import EmptyShardError, IndivisibleError, LayoutError
from .layout_spec import Layout, LayoutSpec
from .tensor_layout import TensorLayout
from . import dtensor  # noqa: F401  (registers the dispatcher's distributed hooks)
from . import rules  # noqa: F401  (registers the per-op sharding rules)
from . import strategy  # noqa: F401  (registers the Redistribute op)
from .grad_reduce import reduce_gradients
from .redistribution.planner import plan_redistribution
from .redistribution.steps import RedistributionError


def local_shape(tensor_or_parameter, rank=None):
    """The shape each device stores of `tensor_or_parameter` (its global shape when it
    is not distributed). When a split does not divide its dim the devices hold pieces
    of two sizes (``numpy.array_split``: the first ``n % k`` parts one row longer): the
    largest piece's shape, or with ``rank=r`` the shape of device ``r``'s own piece."""
    layout = getattr(tensor_or_parameter, "layout", None)
    if layout is None:
        return tuple(tensor_or_parameter.shape)
    if rank is None:
        return tuple(layout.local_shape)
    shape_of = getattr(layout, "local_shape_of", None)
    if shape_of is None:                      # per-device values: one shape on every device
        return tuple(layout.local_shape)
    return shape_of(rank)


__all__ = ["set_algo_parameters", "get_algo_parameters", "reset_algo_parameters",
           "local_shape", "reduce_gradients", "plan_redistribution", "RedistributionError"]
__all__ += ["Layout", "LayoutSpec", "TensorLayout", "LayoutError", "IndivisibleError",
            "EmptyShardError"]
from .report import CommRecord, CommReport, comm_cause  # noqa: E402

__all__ += ["CommReport", "CommRecord", "comm_cause"]
from .device_local import (DeviceLocalLayout, device_local_tensor,  # noqa: E402
                           set_layerwise_slices)

__all__ += ["DeviceLocalLayout", "set_layerwise_slices", "device_local_tensor"]
from .graph.api import compile_count  # noqa: E402

__all__ += ["compile_count"]

# ops run strategies, collectives and ops.shard through this layer's interpreter
from ..ops import interpreter as _interpreter  # noqa: E402
from .eager import ShardedEager  # noqa: E402

_interpreter.install(ShardedEager())
from .report import compiled_comm_times  # noqa: E402

__all__ += ["compiled_comm_times"]
from .check import EquivalenceReport, check_equivalence  # noqa: E402

__all__ += ["check_equivalence", "EquivalenceReport"]
from .visualize import visualize  # noqa: E402

__all__ += ["visualize"]
from .pipeline import PipelineSchedule, pipeline_schedule  # noqa: E402

__all__ += ["pipeline_schedule", "PipelineSchedule"]

from . import auto_parallel  # noqa: E402,F401  (dm.parallel.auto_parallel.AutoParallel)
# the module dualmode.parallel.shard (MindSpore's path of Layout); dm.parallel.shard and
# dm.parallel.reshard are its functions
from .shard import reshard, shard  # noqa: E402

__all__ += ["shard", "reshard"]
from .dry_run import DryRunReport, abstract, dry_run  # noqa: E402

__all__ += ["dry_run", "abstract", "DryRunReport"]
from .optimizer_shard import OptimizerMemory, optimizer_memory  # noqa: E402

__all__ += ["optimizer_memory", "OptimizerMemory"]
