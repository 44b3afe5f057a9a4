"""General transforms for ``Dataset.map`` (MindSpore's ``dataset.transforms``)."""
from __future__ import annotations

import numpy as np

from ..common import dtype as _dt

__all__ = ["TypeCast"]


class TypeCast:
    """Cast a column to `data_type` (a dualmode dtype, numpy dtype or its name)."""

    def __init__(self, data_type):
        self.data_type = np.dtype(_dt.as_dtype(data_type, "TypeCast"))

    def __call__(self, x):
        return np.asarray(x).astype(self.data_type)
