"""dualmode.nn: Cell, layers, losses, optimizers and training wrappers (MindSpore's nn)."""
from . import utils
from .activation import (GELU, FastGelu, PReLU, ReLU, Sigmoid, Softmax, Tanh,
                         get_activation)
from .basic import Dense, Dropout, Flatten
from .cell import Cell
from .container import CellList, SequentialCell
from .embedding import Embedding, EmbeddingLookup
from .loss import (CrossEntropyLoss, L1Loss, LossBase, MSELoss,
                   SoftmaxCrossEntropyWithLogits)
from .conv import Conv2d
from .normalization import BatchNorm1d, BatchNorm2d, LayerNorm
from .pooling import AvgPool2d, MaxPool2d
from .optim import LARS, SGD, Adam, Momentum, Optimizer
from .wrap import TrainOneStepCell, WithLossCell
from .pipeline import MicroBatchInterleaved, PipelineCell

__all__ = [
    "Cell", "SequentialCell", "CellList", "Dense", "Flatten", "Dropout", "ReLU", "Tanh",
    "Sigmoid", "Softmax", "get_activation", "Embedding", "EmbeddingLookup", "LayerNorm", "LossBase",
    "MSELoss", "L1Loss", "CrossEntropyLoss", "SoftmaxCrossEntropyWithLogits", "Optimizer",
    "SGD", "Momentum", "Adam", "LARS", "WithLossCell", "TrainOneStepCell", "utils",
    "Conv2d", "BatchNorm1d", "BatchNorm2d", "MaxPool2d", "AvgPool2d",
    "GELU", "FastGelu", "PReLU",
    "PipelineCell", "MicroBatchInterleaved",
]
