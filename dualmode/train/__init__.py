"""dualmode.train: Model, callbacks and metrics."""
from .callback import (Callback, CallbackList, CheckpointConfig, LossMonitor, ModelCheckpoint,
                       RunContext, TimeMonitor)
from .amp import FixedLossScaleManager
from .metrics import MAE, MSE, Accuracy, Loss, Metric
from .model import Model
from . import group_file  # noqa: F401  (installs the group_ckpt_save_file writer)

__all__ = ["Model", "Callback", "CallbackList", "LossMonitor", "RunContext", "Metric",
           "TimeMonitor", "CheckpointConfig", "ModelCheckpoint",
           "Accuracy", "Loss", "MAE", "MSE", "FixedLossScaleManager"]
