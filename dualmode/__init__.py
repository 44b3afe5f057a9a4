"""dualmode: MindSpore-style eager and graph-mode code, sharded over simulated devices.

    import dualmode as dm
    from dualmode import nn, ops, Tensor, Parameter
"""
from .common.dtype import (bool_, float16, float32, float64, int8, int16, int32, int64,
                           uint8)
from .tensor import Parameter, ParameterTuple, Tensor, no_init_parameters
from . import ops  # noqa: E402  (registers operator ops)
from .autograd import grad, value_and_grad
from .context import (GRAPH_MODE, PYNATIVE_MODE, ParallelMode, get_auto_parallel_context,
                      get_context, get_ps_context, get_seed, reset_auto_parallel_context,
                      reset_ps_context, set_auto_parallel_context, set_context,
                      set_ps_context, set_seed)
from . import common  # noqa: E402
from .common.initializer import initializer  # noqa: E402  (the function; the module is dm.common.initializer)
from . import nn  # noqa: E402
from . import dataset  # noqa: E402
from . import train  # noqa: E402
from .train.serialization import (load_checkpoint, load_param_into_net,  # noqa: E402
                                  save_checkpoint)
from .train.reshard import (load_distributed_checkpoint,  # noqa: E402
                            merge_sliced_checkpoints, transform_checkpoints)
from . import parallel  # noqa: E402
from .parallel import reshard, shard  # noqa: E402  (dm.shard is ops.shard)
from . import communication  # noqa: E402
from . import ps  # noqa: E402  (installs parameter server mode into init())

__version__ = "0.1.0"

__all__ = [
    "Tensor", "Parameter", "ParameterTuple", "no_init_parameters", "ops", "grad", "value_and_grad",
    "set_context", "get_context", "set_seed", "get_seed", "set_auto_parallel_context",
    "get_auto_parallel_context", "reset_auto_parallel_context", "PYNATIVE_MODE",
    "GRAPH_MODE", "ParallelMode", "set_ps_context", "get_ps_context", "reset_ps_context", "nn", "dataset", "train", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "bool_", "save_checkpoint", "load_checkpoint", "load_param_into_net",
    "load_distributed_checkpoint", "merge_sliced_checkpoints", "transform_checkpoints",
    "initializer", "shard", "reshard",
]
