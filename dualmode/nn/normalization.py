"""LayerNorm (on ``ops.LayerNorm``), BatchNorm1d and BatchNorm2d (on ``ops.BatchNorm``):
the cells hold their ops as MindSpore's do, so scripts set their strategies the same way."""
from __future__ import annotations

from .. import ops
from ..common import dtype as _dt
from ._checks import check_float, check_float_tensor, check_int
from .basic import make_parameter
from .cell import Cell

__all__ = ["LayerNorm", "BatchNorm1d", "BatchNorm2d"]


def _axis(owner, name, axis, ndim):
    if not -ndim <= axis < ndim:
        raise ValueError(f"{owner}: {name}={axis} is out of range for an input of rank "
                         f"{ndim}; expected {-ndim} <= {name} < {ndim}")
    return axis % ndim


class LayerNorm(Cell):
    """Layer normalisation: ``(x - mean) / sqrt(var + epsilon) * gamma + beta``.

    Mean and (biased) variance are taken over the axes from `begin_norm_axis` to the
    last; `gamma` and `beta` cover the axes from `begin_params_axis` to the last. The
    computation is one ``ops.LayerNorm`` op, held as ``self.layer_norm``: as in
    MindSpore, ``cell.layer_norm.shard(((8, 1), (1,), (1,)))`` splits the rows.

    Parameters
    ----------
    normalized_shape : tuple or list of ints (an int is taken as a 1-tuple)
        Shape of `gamma` and `beta`: the input's trailing dims from `begin_params_axis`.
    begin_norm_axis, begin_params_axis : int
        First normalised axis and first axis of the parameters (default -1).
    gamma_init, beta_init : str, Initializer, number or Tensor
        Default "ones" and "zeros".
    epsilon : float
        Added to the variance (default 1e-7, as MindSpore).
    dtype : dtype
        Parameter dtype (default float32).
    """

    def __init__(self, normalized_shape, begin_norm_axis=-1, begin_params_axis=-1,
                 gamma_init="ones", beta_init="zeros", epsilon=1e-7, dtype=_dt.float32):
        super().__init__()
        if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
            normalized_shape = (normalized_shape,)
        if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape:
            raise TypeError(f"LayerNorm: normalized_shape must be a non-empty tuple or list "
                            f"of ints, got {normalized_shape!r}")
        self.normalized_shape = tuple(check_int("LayerNorm", "normalized_shape", d, 1)
                                      for d in normalized_shape)
        self.begin_norm_axis = check_int("LayerNorm", "begin_norm_axis", begin_norm_axis)
        self.begin_params_axis = check_int("LayerNorm", "begin_params_axis", begin_params_axis)
        self.epsilon = check_float("LayerNorm", "epsilon", epsilon, 0.0, lo_open=True)
        dtype = _dt.as_dtype(dtype, "LayerNorm")
        self.gamma = make_parameter("LayerNorm", "gamma_init", gamma_init,
                                    self.normalized_shape, dtype, "gamma")
        self.beta = make_parameter("LayerNorm", "beta_init", beta_init,
                                   self.normalized_shape, dtype, "beta")
        # the op, as MindSpore's cell holds it: ``.layer_norm.shard(...)`` sets its strategy
        self.layer_norm = ops.LayerNorm(self.begin_norm_axis, self.begin_params_axis,
                                        self.epsilon)

    def construct(self, x):
        check_float_tensor("LayerNorm", "input", x)
        shape = tuple(x.shape)
        nd = len(shape)
        if nd == 0:
            raise ValueError("LayerNorm: the input is 0-d; expected rank >= 1")
        _axis("LayerNorm", "begin_norm_axis", self.begin_norm_axis, nd)
        par = _axis("LayerNorm", "begin_params_axis", self.begin_params_axis, nd)
        if shape[par:] != self.normalized_shape:
            raise ValueError(f"LayerNorm: input has shape {shape}; its dims from "
                             f"begin_params_axis={self.begin_params_axis} are {shape[par:]} "
                             f"but normalized_shape is {self.normalized_shape}")
        gamma, beta = self.gamma, self.beta
        if gamma.dtype != x.dtype:           # as MindSpore: the parameters in x's dtype
            gamma, beta = ops.cast(gamma, x.dtype), ops.cast(beta, x.dtype)
        y, _, _ = self.layer_norm(x, gamma, beta)
        return y

    def extend_repr(self):
        return (f"normalized_shape={self.normalized_shape}, "
                f"begin_norm_axis={self.begin_norm_axis}, "
                f"begin_params_axis={self.begin_params_axis}")


class _BatchNorm(Cell):
    """What BatchNorm1d and BatchNorm2d share: the parameters and the two ops, as
    MindSpore's cells hold them: ``self.bn_train = ops.BatchNorm(is_training=True, ...)``
    (batch statistics, running statistics updated) and ``self.bn_infer =
    ops.BatchNorm(is_training=False, ...)`` (running statistics), so
    ``cell.bn_train.shard(((8, 1, 1, 1), (1,), (1,), (1,), (1,)))`` sets the strategy of
    the training op."""

    _owner = "BatchNorm"
    _ranks = ()              # accepted input ranks
    _expect = ""             # the expected input shape, for messages

    def __init__(self, num_features, eps=1e-5, momentum=0.9, affine=True, gamma_init="ones",
                 beta_init="zeros", moving_mean_init="zeros", moving_var_init="ones",
                 use_batch_statistics=None, data_format="NCHW", dtype=_dt.float32):
        super().__init__()
        owner = self._owner
        self.num_features = check_int(owner, "num_features", num_features, 1)
        self.eps = check_float(owner, "eps", eps, 0.0, lo_open=True)
        self.momentum = check_float(owner, "momentum", momentum, 0.0, 1.0)
        if use_batch_statistics not in (None, True, False):
            raise TypeError(f"{owner}: use_batch_statistics must be None or a bool, got "
                            f"{use_batch_statistics!r}")
        if data_format != "NCHW":
            raise ValueError(f"{owner}: data_format={data_format!r} is not supported; "
                             f"only 'NCHW'")
        self.use_batch_statistics = use_batch_statistics
        dtype = _dt.as_dtype(dtype, owner)
        shape = (self.num_features,)
        self.gamma = make_parameter(owner, "gamma_init", gamma_init, shape, dtype, "gamma")
        self.beta = make_parameter(owner, "beta_init", beta_init, shape, dtype, "beta")
        self.gamma.requires_grad = self.beta.requires_grad = bool(affine)
        self.moving_mean = make_parameter(owner, "moving_mean_init", moving_mean_init,
                                          shape, dtype, "moving_mean")
        self.moving_variance = make_parameter(owner, "moving_var_init",
                                              moving_var_init, shape, dtype,
                                              "moving_variance")
        self.moving_mean.requires_grad = self.moving_variance.requires_grad = False
        # the op's momentum weighs the batch (MindSpore passes 1 - momentum too)
        self.bn_train = ops.BatchNorm(is_training=True, epsilon=self.eps,
                                      momentum=1.0 - self.momentum)
        self.bn_infer = ops.BatchNorm(is_training=False, epsilon=self.eps)

    def construct(self, x):
        check_float_tensor(self._owner, "input", x)
        if x.ndim not in self._ranks or x.shape[1] != self.num_features:
            raise ValueError(f"{self._owner}: input has shape {tuple(x.shape)}; expected "
                             f"{self._expect.format(c=self.num_features)}")
        in_dtype = x.dtype
        if in_dtype != self.gamma.dtype:            # float16 compute: statistics in float32
            x = ops.cast(x, self.gamma.dtype)
        use_batch = self.training if self.use_batch_statistics is None \
            else self.use_batch_statistics
        bn = self.bn_train if use_batch else self.bn_infer
        y = bn(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]
        return y if y.dtype == in_dtype else ops.cast(y, in_dtype)

    def extend_repr(self):
        return (f"num_features={self.num_features}, eps={self.eps}, "
                f"momentum={self.momentum}")


_BN_DOC = """

    Training (``set_train()``, or ``use_batch_statistics=True``): each channel is
    normalised with the batch's mean and biased variance — under data parallel or a
    strategy splitting the batch those of the whole global batch (one AllReduce of
    per-channel sums and sums of squares inside the op), so results equal one device —
    and the moving statistics become ``momentum * moving + (1 - momentum) * batch`` (the
    variance unbiased). Inference: the moving statistics are used. Statistics are
    float32 even when x is float16 (``amp_level="O2"``); y has x's dtype. The ops are
    ``self.bn_train`` and ``self.bn_infer`` (``ops.BatchNorm``), as in MindSpore: their
    ``shard`` sets the strategy (x, gamma, beta, moving mean, moving variance).

    Parameters
    ----------
    num_features : int
        Channels C.
    eps : float
        Added to the variance (default 1e-5).
    momentum : float
        Weight of the old moving statistics (default 0.9, MindSpore's convention).
    affine : bool
        Learn gamma and beta (default True); otherwise they are fixed ones and zeros.
    gamma_init, beta_init, moving_mean_init, moving_var_init : initializers
        Defaults "ones", "zeros", "zeros", "ones".
    use_batch_statistics : bool or None
        None (default): batch statistics while training, moving ones otherwise.
    """


class BatchNorm1d(_BatchNorm):
    __doc__ = """Batch normalisation over the features (dim 1) of (N, C) or (N, C, L) input
    (MindSpore's ``nn.BatchNorm1d``).""" + _BN_DOC
    _owner = "BatchNorm1d"
    _ranks = (2, 3)
    _expect = "(N, {c}) or (N, {c}, L)"


class BatchNorm2d(_BatchNorm):
    __doc__ = """Batch normalisation over the channels (dim 1) of NCHW input (MindSpore's
    ``nn.BatchNorm2d``).""" + _BN_DOC
    _owner = "BatchNorm2d"
    _ranks = (4,)
    _expect = "(N, {c}, H, W)"
