"""Optimizers: called with the gradient tuple, ``optimizer(grads)``."""
from .adam import Adam
from .lars import LARS
from .momentum import Momentum
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "LARS"]
