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
    """The attention sublayer's output as the FFN reads it: `x` for its first linear, `residual` for its closing
    norm's residual, the same values. Two tensors so that their gradients can reach the norm that made them apart:
    under delayed float8 that norm's backward kernel adds them as it reads them (bert.model.fp8_residual_norm), where
    one tensor read twice has autograd add them first, in a pass of its own: a (T, hidden) tensor read twice and
    written once, 3.5 GB of BERT-large's float8 step at 24,576 tokens on the fake H100. (In bf16 inductor gives
    that add to cuBLAS, the FFN's input-gradient GEMM adding onto the residual's, free: the other norms return one
    tensor twice.) An alias, not a copy: a compiled graph that returns both collapses them into one gradient again
    (AOT autograd regenerates the alias outside the graph), so a layer's own output, which leaves the graph under
    COMPILE_SCOPE=layers, stays one tensor."""

    x: Tensor
    residual: Tensor
    # x in e4m3 and 1 / its scale, where the close that made x cast it for the next float8 linear
    # (bert.model.fp8_attention_block's, for the FFN's: its norm's kernel writes both)
    float8: tuple[Tensor, Tensor] | None = None


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

    def after(self, opening: nn.Module, stream: Stream) -> Tensor:
        """This close of `opening`(stream.x), the sublayer's first unit: a close fused with its opening
        (bert.model.fp8_feed_forward) runs both at once."""
        return self(opening(stream.x), stream.residual)

    def paired_after(self, opening: nn.Module, x: Tensor, *args, into: nn.Module | None = None) -> Stream:
        """`paired` of `opening`(x, *args), the sublayer's first unit, over the residual x (`after`'s, as a Stream).
        `into`: the next sublayer's first unit, for a close that casts its output for it
        (bert.model.fp8_attention_block)."""
        return self.paired(opening(x, *args), x)

    def paired(self, h: Tensor, residual: Tensor) -> Stream:
        """The output as a Stream: here one tensor twice, whose two gradients autograd adds."""
        y = self(h, residual)
        return Stream(y, y)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertResidualOutput(cfg, cfg.hidden_size)

    def forward(self, x: Tensor, attend: Attend, rows: Tensor | None = None, into: nn.Module | None = None
                ) -> Stream:
        """`rows`: after attention, go on with these token rows only (the last-layer subset, `last_layer.py`).
        `into`: the unit the output goes into next (`paired_after`)."""
        if rows is None:
            return self.output.paired_after(self.self, x, attend, into=into)
        h = self.self(x, attend)
        return self.output.paired(h.index_select(0, rows), x.index_select(0, rows))


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

    def forward(self, x: Tensor, attend: Attend, rows: Tensor | None = None) -> Tensor:
        return self.output.after(self.intermediate, self.attention(x, attend, rows, into=self.intermediate))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: Tensor, attend: Attend, last_rows: Tensor | None = None) -> Tensor:
        """Every layer on every token; `last_rows`: the last layer's output holds only these rows."""
        *layers, last = self.layer
        for layer in layers:
            x = layer(x, attend)
        return last(x, attend, last_rows)


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
