"""BERT's embedding, encoder and pooler, shape-agnostic over the leading token axes.

Every module maps (..., hidden) to (..., hidden): the unpadded model feeds (T, hidden), the padded
reference (B, L, hidden). Only attention needs to know which tokens belong together, and it gets
that as an `Attend` function (see `attention.py`). Module and parameter names follow Google's and
Hugging Face's BERT (`encoder.layer.N.attention.output.dense`, `LayerNorm`), so imported checkpoints
map one to one and weight decay can skip names containing `bias` or `LayerNorm`. The one exception
is the fused `attention.self.qkv` (rows: query, then key, then value), which `checkpoint.py` maps to
and from the separate `query`/`key`/`value` tensors of every other BERT.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from bert.model.attend import Attend
from bert.model.config import BertConfig


class Stream(NamedTuple):
    """A sublayer's output as the next sublayer reads it: `x` for its first linear, `residual` for its closing
    norm's residual, the same values. Two tensors so that their gradients can reach the norm that made them apart:
    under delayed float8 that norm's backward kernel adds them as it reads them (bert.model.fp8_residual_norm), where
    one tensor read twice has autograd add them first, in a pass of its own: a (T, hidden) tensor read twice and
    written once, 6.9 GB of BERT-large's float8 step at 24,576 tokens on the fake H100. (In bf16 inductor gives
    that add to cuBLAS, the next input-gradient GEMM adding onto the residual's, free: the other norms return one
    tensor twice.) Within a layer an alias will do; a layer's output, which leaves its graph under
    COMPILE_SCOPE=layers, must be two tensors apart (the norm writes it twice), because a compiled graph that
    returns an alias collapses the two into one gradient again (AOT autograd regenerates the alias outside the
    graph)."""

    x: Tensor
    residual: Tensor
    # x in e4m3, 1 / its scale, its amax and the copy transposed (None where that linear's weight wants no
    # gradient), where the close that made x cast it for the next float8 linear, with that linear's delayed scale:
    # the linear skips its own cast and its input's transpose and keeps the amax (bert.model.fp8_attention_block
    # and bert.model.fp8_feed_forward, whose norms' kernels write the copies)
    float8: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, position_ids: Tensor, segment_ids: Tensor) -> Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        x = x + self.token_type_embeddings(segment_ids)
        return self.dropout(self.LayerNorm(x))


QKV_PARTS = ("query", "key", "value")  # the order of the row blocks of the fused `qkv` weight and bias


class BertSelfAttention(nn.Module):
    """Q, K and V from one GEMM of width 3 x hidden: on an H100, BERT-large's three N = 1024 projections
    ran at 624 TFLOP/s, the same tokens through one N = 3072 GEMM at 738 (issue 9)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads, self.dropout_p = cfg.num_attention_heads, cfg.attention_probs_dropout_prob
        self.qkv = nn.Linear(cfg.hidden_size, len(QKV_PARTS) * cfg.hidden_size)

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        # (T, 3 x hidden) -> (T, 3, heads, head_dim), packed for the backend (bert.model.attend); the flash kernels
        # take its strided q, k, v views. The function, not the method: dynamo inlines Tensor.unflatten's Python on
        # a fake tensor (bench/fake_h100.py) and breaks the graph there, so the fake H100 would trace other graphs
        qkv = torch.unflatten(self.qkv(x), -1, (len(QKV_PARTS), self.heads, -1))
        return attend(qkv, self.dropout_p if self.training else 0.0).flatten(-2)


class BertResidualOutput(nn.Module):
    """dense -> dropout -> + residual -> LayerNorm (post-LN), closing both attention and feed-forward."""

    def __init__(self, cfg: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)

    def after(self, opening: nn.Module, stream: Stream, *args, into: nn.Module | None = None) -> Stream:
        """This close of `opening`(stream.x, *args), the sublayer's first unit, over stream.residual, as a Stream
        (`paired`). `into`: the unit the output goes into next, for a close that casts its output for it; a close
        fused with its opening (bert.model.fp8_feed_forward, bert.model.fp8_attention_block) runs both at once."""
        return self.paired(opening(stream.x, *args), stream.residual)

    def paired(self, h: Tensor, residual: Tensor) -> Stream:
        """The output as a Stream: here one tensor twice, whose two gradients autograd adds."""
        y = self(h, residual)
        return Stream(y, y)

    def ends(self, opening: nn.Module, stream: Stream, into: nn.Module | None = None) -> Stream:
        """`after`, closing the layer: the output leaves it (a compiled graph's edge under COMPILE_SCOPE=layers,
        where an alias folds back into one gradient), so it is one tensor twice, unless a close writes it twice
        apart (bert.model.fp8_feed_forward's). `into`: the next layer's attention."""
        y = self(opening(stream.x), stream.residual)
        return Stream(y, y)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertResidualOutput(cfg, cfg.hidden_size)

    def forward(self, stream: Stream, attend: Attend, rows: Tensor | None = None, into: nn.Module | None = None
                ) -> Stream:
        """`rows`: after attention, go on with these token rows only (the last-layer subset, `last_layer.py`).
        `into`: the unit the output goes into next (`BertResidualOutput.after`)."""
        if rows is None:
            return self.output.after(self.self, stream, attend, into=into)
        h = self.self(stream.x, attend)
        return self.output.paired(h.index_select(0, rows), stream.residual.index_select(0, rows))


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.activation = nn.GELU()  # exact (erf) GELU, as in Google's BERT; a module, so GELU=rational can swap it

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertResidualOutput(cfg, cfg.intermediate_size)

    def forward(self, x: Tensor | Stream, attend: Attend, rows: Tensor | None = None,
                into: BertAttention | None = None) -> Stream:
        """The layer over x (a Stream, or one tensor for both its reads); `into`: the next layer's attention, for a
        close that casts its output for the next float8 linear (bert.model.fp8_feed_forward)."""
        stream = x if isinstance(x, Stream) else Stream(x, x)
        stream = self.attention(stream, attend, rows, into=self.intermediate)
        return self.output.ends(self.intermediate, stream, into=into)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: Tensor, attend: Attend, last_rows: Tensor | None = None) -> Tensor:
        """Every layer on every token; `last_rows`: the last layer's output holds only these rows. Each layer hands
        the next its output as a Stream, told the next's attention (`into`)."""
        stream = Stream(x, x)
        for layer, following in zip(self.layer[:-1], self.layer[1:]):
            stream = layer(stream, attend, into=following.attention)
        return self.layer[-1](stream, attend, last_rows).x


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls_rows: Tensor) -> Tensor:
        return self.dense(cls_rows).tanh()


class BertModel(nn.Module):
    """Container of the shared trunk; `BertForPreTraining` decides how tokens are laid out."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)
