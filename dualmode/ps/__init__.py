"""dualmode.ps: parameter server mode over ZeroMQ.

    import dualmode as dm
    dm.set_ps_context(enable_ps=True)            # before init()
    dm.communication.init()                      # scheduler / servers: serve, then exit
    net = Net(); net.set_param_ps()              # workers: these weights live on servers
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    ...                                          # opt(grads) pushes and pulls

Roles come from DM_ROLE / MS_ROLE and the other variables of :mod:`.env`;
``python -m dualmode.run --ps --server_num S --worker_num W train.py`` starts them all.
Modules: :mod:`.transport` (messages), :mod:`.env` (roles), :mod:`.scheduler`,
:mod:`.server`, :mod:`.worker`, :mod:`.placement`, :mod:`.optim` (the optimizer a
server runs), :mod:`.embedding` (sparse rows and the worker-side cache),
:mod:`.launch` (the launcher's ``--ps``). See ``docs/parameter_server.md``.
"""
from ..communication.management import set_ps_join
from ..context import get_ps_context, reset_ps_context, set_ps_context
from .embedding import RowCache
from .role import join
from .transport import PSError
from .worker import WorkerClient, active_worker

set_ps_join(join)


def pull_weights(params) -> None:
    """On a parameter server worker, make every server-held weight among `params` (a
    list of Parameters, or a Cell) equal to the servers' value now (pulled whole).
    Reading a weight (``asnumpy``, numpy, ``save_checkpoint``) already does this for a
    copy that may be stale (a sparse table's rows this worker did not use lately, any
    server-held weight in async mode); this is the explicit form. Does nothing outside
    a worker."""
    worker = active_worker()
    if worker is None:
        return
    if hasattr(params, "get_parameters"):
        params = list(params.get_parameters())
    worker.pull_tables(params)

__all__ = ["set_ps_context", "get_ps_context", "reset_ps_context", "active_worker",
           "WorkerClient", "RowCache", "PSError", "pull_weights"]
