"""A small GPT written with sharded primitives, Megatron style.

``GPTConfig`` holds the sizes (vocabulary, sequence, hidden, heads, layers) and the
parallel degrees (dp, mp, pp, micro_size); ``GPT(config)`` is the network that returns
the mean next-token cross-entropy of a batch:

- a vocabulary-parallel embedding (the table's rows split over mp; each device looks up
  the ids of its rows and the partial embeddings are summed), plus learned positions;
- ``num_layers`` blocks of causal self-attention and an MLP, each behind a LayerNorm
  (pre-norm), with GeLU between the MLP's two linear layers. The query, key and value
  projections and the MLP's first linear layer are column-parallel (their output dim
  split over mp: each device holds whole heads), the attention's output projection and
  the MLP's second linear layer row-parallel (their input dim split over mp, the
  products summed over mp); the batch is split over dp everywhere;
- a final LayerNorm and the tied output embedding: the logits' MatMul reads the same
  embedding table (split over mp, so the logits come split over the vocabulary);
- the mean cross-entropy of the logits against the next tokens.

With pp > 1 the blocks are placed on pipeline stages (``block.pipeline_stage``): the
embedding with the first stage, the final LayerNorm and the loss with the last.

Import it from the scripts beside it (``from gpt_model import GPT, GPTConfig``) or put
the examples directory on ``sys.path``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

import dualmode as dm
from dualmode import Parameter, Tensor, nn, ops
from dualmode.common.initializer import Normal, initializer
from dualmode.parallel import Layout

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP", "causal_mask",
           "synthetic_batch"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model and its parallel degrees.

    ``batch_size`` is the global batch; with pp > 1 it is cut into ``micro_size``
    micro-batches. ``dp * mp * pp`` devices run the model.
    """
    vocab_size: int = 64
    seq_length: int = 8
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    batch_size: int = 8
    dp: int = 1
    mp: int = 1
    pp: int = 1
    micro_size: int = 1
    init_std: float = 0.02
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for key in ("vocab_size", "seq_length", "hidden_size", "num_heads", "num_layers",
                    "batch_size", "dp", "mp", "pp", "micro_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig: {key}={v!r} must be an int >= 1")
        rules = [
            ("hidden_size", self.hidden_size % self.num_heads == 0,
             f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}"),
            ("num_heads", self.num_heads % self.mp == 0,
             f"mp={self.mp} must divide num_heads={self.num_heads} (each device holds "
             f"whole heads)"),
            ("vocab_size", self.vocab_size % self.mp == 0,
             f"mp={self.mp} must divide vocab_size={self.vocab_size} (the embedding "
             f"table's rows are split over mp)"),
            ("batch_size", self.batch_size % (self.dp * self.micro_size) == 0,
             f"dp * micro_size = {self.dp * self.micro_size} must divide "
             f"batch_size={self.batch_size}"),
            ("num_layers", self.num_layers >= self.pp,
             f"pp={self.pp} stages need at least {self.pp} blocks, got "
             f"num_layers={self.num_layers}"),
        ]
        for key, ok, msg in rules:
            if not ok:
                raise ValueError(f"GPTConfig: {key}: {msg}")

    @property
    def device_num(self) -> int:
        return self.dp * self.mp * self.pp

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def stage_of(self, layer: int) -> int:
        """The pipeline stage of block `layer` (contiguous, as even as possible)."""
        return layer * self.pp // self.num_layers


def causal_mask(seq_length: int) -> np.ndarray:
    """(S, S) bool: query i may attend to keys 0..i."""
    return np.tril(np.ones((seq_length, seq_length), dtype=bool))


@functools.lru_cache(maxsize=8)
def _mask_constants(seq_length):
    """The causal mask (1, 1, S, S) and the fill of the masked scores, made once per
    sequence length and shared by every attention block (at S = 2048 they are 20 MB)."""
    return (Tensor(causal_mask(seq_length)[None, None]),
            Tensor(np.full((1, 1, seq_length, seq_length), -1e9, np.float32)))


def mesh(dp, mp):
    """The device matrix of one stage, dp the outer axis and mp the inner (fastest)
    one, as the strategy tuples that split both put them. Ops that split only the
    batch take their strategy as a Layout on it, so that their dp is the same devices'
    dp (a tuple ``(dp, 1)`` on dp * mp devices would put the repeated factor outermost
    and dp inner)."""
    return Layout((dp, mp), ("dp", "mp"))


def _param(shape, name, std=None):
    if std is None:
        init = "zeros"
    elif std == "ones":
        init = "ones"
    else:
        init = Normal(std)
    return Parameter(initializer(init, shape, dm.float32), name=name)


class Linear(nn.Cell):
    """``x @ weight + bias`` on 2-D input, weight (in, out). `kind` "column" splits the
    output dim over mp, "row" the input dim (the product is then summed over mp), with
    the rows over dp."""

    def __init__(self, n_in, n_out, kind, dp, mp, std, name):
        super().__init__()
        self.weight = _param((n_in, n_out), f"{name}.weight", std)
        self.bias = _param((n_out,), f"{name}.bias")
        self.matmul = ops.MatMul()
        self.bias_add = ops.Add()
        if kind == "column":
            self.matmul.shard(((dp, 1), (1, mp)))
            self.bias_add.shard(((dp, mp), (mp,)))
        elif kind == "row":
            lay = mesh(dp, mp)
            self.matmul.shard(((dp, mp), (mp, 1)))
            self.bias_add.shard((lay("dp", "None"), lay("None")))
        else:
            raise ValueError(f"Linear: kind={kind!r} must be 'column' or 'row'")

    def construct(self, x):
        return self.bias_add(self.matmul(x, self.weight), self.bias)


class LayerNorm(nn.Cell):
    """LayerNorm over the last dim of 2-D input (B*S, H), rows split over dp."""

    def __init__(self, hidden, dp, mp, eps, name):
        super().__init__()
        self.gamma = _param((hidden,), f"{name}.gamma", "ones")
        self.beta = _param((hidden,), f"{name}.beta")
        lay = mesh(dp, mp)
        self.layer_norm = ops.LayerNorm(-1, -1, eps).shard((lay("dp", "None"), lay("None"),
                                                            lay("None")))

    def construct(self, x):
        return self.layer_norm(x, self.gamma, self.beta)[0]


class Attention(nn.Cell):
    """Causal multi-head self-attention on (B*S, H) rows: heads split over mp, the batch
    over dp. BatchMatMul for the scores and the context, Softmax over the keys, the mask
    applied with Select (masked scores set to -1e9 before the softmax)."""

    def __init__(self, config: GPTConfig, name):
        super().__init__()
        c, dp, mp = config, config.dp, config.mp
        h = c.hidden_size
        std = c.init_std
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.cfg = c
        self.query = Linear(h, h, "column", dp, mp, std, f"{name}.query")
        self.key = Linear(h, h, "column", dp, mp, std, f"{name}.key")
        self.value = Linear(h, h, "column", dp, mp, std, f"{name}.value")
        self.projection = Linear(h, h, "row", dp, mp, out_std, f"{name}.projection")
        heads4 = (dp, 1, mp, 1)
        self.reshape = ops.Reshape()
        self.transpose_q = ops.Transpose().shard((heads4,))
        self.transpose_k = ops.Transpose().shard((heads4,))
        self.transpose_v = ops.Transpose().shard((heads4,))
        self.transpose_back = ops.Transpose().shard(((dp, mp, 1, 1),))
        self.scores = ops.BatchMatMul(transpose_b=True).shard(((dp, mp, 1, 1),
                                                              (dp, mp, 1, 1)))
        self.scale = ops.Mul().shard(((dp, mp, 1, 1), ()))
        self.select = ops.Select().shard(((1, 1, 1, 1), (dp, mp, 1, 1), (1, 1, 1, 1)))
        self.softmax = ops.Softmax(-1).shard(((dp, mp, 1, 1),))
        self.context = ops.BatchMatMul().shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.mask, self.fill = _mask_constants(c.seq_length)

    def _heads(self, x, transpose, batch):
        c = self.cfg
        x = self.reshape(x, (batch, c.seq_length, c.num_heads, c.head_dim))
        return transpose(x, (0, 2, 1, 3))                     # (B, heads, S, head_dim)

    def construct(self, x):
        c = self.cfg
        batch = x.shape[0] // c.seq_length
        q = self._heads(self.query(x), self.transpose_q, batch)
        k = self._heads(self.key(x), self.transpose_k, batch)
        v = self._heads(self.value(x), self.transpose_v, batch)
        s = self.scale(self.scores(q, k), 1.0 / math.sqrt(c.head_dim))
        s = self.select(self.mask, s, self.fill)
        ctx = self.context(self.softmax(s), v)                 # (B, heads, S, head_dim)
        ctx = self.transpose_back(ctx, (0, 2, 1, 3))
        ctx = self.reshape(ctx, (batch * c.seq_length, c.hidden_size))
        return self.projection(ctx)


class MLP(nn.Cell):
    """Column-parallel (H -> 4H), GeLU, row-parallel (4H -> H)."""

    def __init__(self, config: GPTConfig, name):
        super().__init__()
        c, dp, mp = config, config.dp, config.mp
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.mapping = Linear(c.hidden_size, 4 * c.hidden_size, "column", dp, mp,
                              c.init_std, f"{name}.mapping")
        self.gelu = ops.GeLU().shard(((dp, mp),))
        self.projection = Linear(4 * c.hidden_size, c.hidden_size, "row", dp, mp, out_std,
                                 f"{name}.projection")

    def construct(self, x):
        return self.projection(self.gelu(self.mapping(x)))


class Block(nn.Cell):
    """x + attention(ln1(x)), then + mlp(ln2(.)), on (B*S, H) rows."""

    def __init__(self, config: GPTConfig, layer):
        super().__init__()
        dp, name = config.dp, f"blocks.{layer}"
        self.ln1 = LayerNorm(config.hidden_size, dp, config.mp, config.layer_norm_eps,
                             f"{name}.ln1")
        self.attention = Attention(config, f"{name}.attention")
        self.ln2 = LayerNorm(config.hidden_size, dp, config.mp, config.layer_norm_eps,
                             f"{name}.ln2")
        self.mlp = MLP(config, f"{name}.mlp")
        lay = mesh(dp, config.mp)
        self.add1 = ops.Add().shard((lay("dp", "None"), lay("dp", "None")))
        self.add2 = ops.Add().shard((lay("dp", "None"), lay("dp", "None")))

    def construct(self, x):
        x = self.add1(x, self.attention(self.ln1(x)))
        return self.add2(x, self.mlp(self.ln2(x)))


class Embedding(nn.Cell):
    """Vocabulary-parallel token embedding (the table's rows split over mp) plus learned
    positions; returns (B*S, H) rows."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c, dp, mp = config, config.dp, config.mp
        self.cfg = c
        self.embedding_table = _param((c.vocab_size, c.hidden_size), "embedding_table",
                                      c.init_std)
        self.position_embedding = _param((c.seq_length, c.hidden_size),
                                         "position_embedding", c.init_std)
        lay = mesh(dp, mp)
        self.gather = ops.Gather().shard((lay("mp", "None"), lay("dp", "None")))
        self.add = ops.Add().shard((lay("dp", "None", "None"), lay("None", "None")))
        self.reshape = ops.Reshape()

    def construct(self, ids):
        c = self.cfg
        x = self.add(self.gather(self.embedding_table, ids, 0), self.position_embedding)
        return self.reshape(x, (ids.shape[0] * c.seq_length, c.hidden_size))


class Head(nn.Cell):
    """Final LayerNorm, logits by the tied embedding table (vocabulary split over mp),
    mean cross-entropy against the next tokens."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c, dp, mp = config, config.dp, config.mp
        self.ln_f = LayerNorm(c.hidden_size, dp, mp, c.layer_norm_eps, "ln_f")
        self.logits = ops.MatMul(transpose_b=True).shard(((dp, 1), (mp, 1)))
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        lay = mesh(dp, mp)
        self.loss.sparse_softmax_cross_entropy.shard((lay("dp", "None"), lay("dp")))
        self.reshape = ops.Reshape()

    def construct(self, x, table, labels):
        logits = self.logits(self.ln_f(x), table)
        return self.loss(logits, self.reshape(labels, (-1,)))


class GPT(nn.Cell):
    """``GPT(config)(ids, labels)`` -> the mean cross-entropy (a scalar); ids and labels
    are (B, S) int32 (labels: the ids shifted by one)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.blocks = nn.CellList([Block(config, i) for i in range(config.num_layers)])
        self.head = Head(config)
        if config.pp > 1:
            self.embedding.pipeline_stage = 0
            for i, block in enumerate(self.blocks):
                block.pipeline_stage = config.stage_of(i)
            self.head.pipeline_stage = config.pp - 1

    def construct(self, ids, labels):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x, self.embedding.embedding_table, labels)


def synthetic_batch(config: GPTConfig, rng: np.random.Generator):
    """(ids, labels), each (batch_size, seq_length) int32: sequences that follow a fixed
    random bigram table (drawn from one generator, so every run sees the same one), so
    the loss can fall; labels are the ids shifted by one."""
    table = np.random.default_rng(2024).integers(0, config.vocab_size, config.vocab_size)
    first = rng.integers(0, config.vocab_size, config.batch_size)
    seq = np.empty((config.batch_size, config.seq_length + 1), np.int64)
    seq[:, 0] = first
    for t in range(config.seq_length):
        nxt = table[seq[:, t]]
        noise = rng.random(config.batch_size) < 0.1
        seq[:, t + 1] = np.where(noise, rng.integers(0, config.vocab_size, config.batch_size),
                                 nxt)
    return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)
