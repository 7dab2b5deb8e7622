"""BERT for pre-training on unpadded batches: MLM + NSP heads, losses and MLM accuracy.

`forward` never pads: embeddings and encoder run on the (T, hidden) token axis, the pooler takes
the [CLS] rows at `cu_seqlens[:-1]`, and the MLM head runs only on the masked rows (NVIDIA's
"dense sequence output"); with `last_layer_subset` the last layer already keeps only those rows after its
attention (`last_layer.py`). `forward_padded` runs the same weights on a zero-padded (B, L) batch with
a key-padding mask: the reference for tests and the baseline for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert.batch import Batch
from bert.model.attend import unpacked
from bert.model.attention import BACKENDS, masked_sdpa, resolve_backend
from bert.model.config import BertConfig
from bert.model.last_layer import kept_rows, split_kept
from bert.model.layers import BertModel
from bert.model.padding import PadLayout, pad


@dataclass
class PretrainOutput:
    loss: Tensor  # mlm_loss + nsp_loss
    mlm_loss: Tensor  # mean over masked tokens
    nsp_loss: Tensor  # mean over sequences
    mlm_correct: Tensor  # int64 scalar: masked tokens predicted right (a tensor, so it can be all-reduced)
    mlm_total: Tensor  # int64 scalar: masked tokens
    mlm_logits: Tensor  # (M, real_vocab_size): the padding classes are sliced off
    nsp_logits: Tensor  # (B, 2)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.GELU()
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.activation(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform, then the decoder tied to the word embeddings (passed in, so it is stored once).

    The decoder computes all `vocab_size` columns (a multiple of 8, for the GEMM) and returns the first
    `real_vocab_size`: the padding classes are not in the softmax, the loss or the argmax, so the loss
    is the unpadded model's exactly, no prediction is a padding class, and the padding rows of the
    word embeddings and of `bias` get zero gradient. Slicing is exact (the kept columns are untouched)
    and costs at most one copy of the (M, vocab) logits, which the fp32 cast for the loss does anyway
    under autocast; an additive -inf mask would cost the same pass and leave -inf in the logits.
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.real_vocab_size = cfg.real_vocab_size

    def forward(self, x: Tensor, word_embeddings: Tensor) -> Tensor:
        return F.linear(self.transform(x), word_embeddings, self.bias)[..., : self.real_vocab_size]


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


class BertForPreTraining(nn.Module):
    def __init__(self, cfg: BertConfig, attention: str = "auto", device: torch.device | str | None = None,
                 last_layer_subset: bool = True):
        """`attention` names a backend of `bert.model.attention`; `auto` is resolved here, for `device`.
        `last_layer_subset`: the last layer computes only the rows the losses read (exact; `last_layer.py`)."""
        super().__init__()
        self.config, self.last_layer_subset = cfg, last_layer_subset
        self.attention = resolve_backend(attention, device)
        # Planning is host work (numpy, Python lists): under torch.compile it stays eager, so a new batch's
        # lengths do not recompile the graph; the plan's tensors and sizes enter the graph as inputs.
        self.plan_attention = torch.compiler.disable(BACKENDS[self.attention])
        self.bert = BertModel(cfg)
        self.cls = BertPreTrainingHeads(cfg)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # Google's BERT: normal(0, 0.02) truncated at two standard deviations, zero biases, unit LayerNorm.
        if isinstance(module, nn.Linear | nn.Embedding):
            std = self.config.initializer_range
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def encode(self, batch: Batch, last_layer_subset: bool = False) -> Tensor:
        """The encoder's output for every token, (T, hidden), or with `last_layer_subset` for `kept_rows` only."""
        # host-side planning, once for all layers, and first: under COMPILE it splits the graph, and work before it
        # would be a graph of its own
        attend = self.plan_attention(batch.seq)
        x = self.bert.embeddings(batch.input_ids, batch.position_ids, batch.segment_ids)
        return self.bert.encoder(x, attend, kept_rows(batch) if last_layer_subset else None)

    def forward(self, batch: Batch) -> PretrainOutput:
        if self.last_layer_subset:
            return self.heads(*split_kept(self.encode(batch, last_layer_subset=True), batch), batch)
        x = self.encode(batch)
        cls_rows = x.index_select(0, batch.seq.cu_seqlens[:-1])
        return self.heads(x.index_select(0, batch.masked_positions), cls_rows, batch)

    def forward_padded(self, batch: Batch, width: int | None = None) -> PretrainOutput:
        """Same weights on a zero-padded (B, width) batch with a key-padding mask (width: batch max)."""
        layout = PadLayout.build(batch.seq, width=width)
        x = self.bert.embeddings(pad(batch.input_ids, layout), pad(batch.position_ids, layout),
                                 pad(batch.segment_ids, layout))  # (B, L, hidden)
        x = self.bert.encoder(x, unpacked(lambda q, k, v, p: masked_sdpa(q, k, v, layout.key_mask, p)))
        masked_rows = x.flatten(0, 1).index_select(0, layout.slots.index_select(0, batch.masked_positions))
        return self.heads(masked_rows, x[:, 0], batch)

    def heads(self, masked_rows: Tensor, cls_rows: Tensor, batch: Batch) -> PretrainOutput:
        """The MLM head on the masked rows, the NSP head on the [CLS] rows, the losses and the MLM accuracy."""
        mlm_logits = self.cls.predictions(masked_rows, self.bert.embeddings.word_embeddings.weight)
        nsp_logits = self.cls.seq_relationship(self.bert.pooler(cls_rows))
        # Labels of -100 (cross_entropy's ignore_index) are padding rows (`bert.static_shapes`): out of both
        # losses, the accuracy and the count. The count is a device tensor (no sync); the MLM loss is a sum
        # over max(count, 1), so a batch without masked tokens has loss 0, not the NaN of an empty mean.
        total = (batch.masked_labels >= 0).sum()
        mlm_sum = F.cross_entropy(_at_least_fp32(mlm_logits), batch.masked_labels, reduction="sum")
        mlm_loss = mlm_sum / total.clamp(min=1)
        nsp_loss = F.cross_entropy(_at_least_fp32(nsp_logits), batch.nsp_labels)
        correct = (mlm_logits.argmax(-1) == batch.masked_labels).sum()
        return PretrainOutput(mlm_loss + nsp_loss, mlm_loss, nsp_loss, correct, total, mlm_logits, nsp_logits)


def shapes_only(cfg: BertConfig, attention: str = "padded") -> BertForPreTraining:
    """The model with every parameter on the meta device: names and shapes, no storage, no initialisation, for
    counting and planning (`device=` of the constructor only picks the attention backend; drawing BERT-large's
    weights on the CPU takes most of a CPU-minute)."""
    with torch.device("meta"):
        return BertForPreTraining(cfg, attention=attention, device="meta")


def _at_least_fp32(logits: Tensor) -> Tensor:
    # Softmax over 30k classes in bf16 loses the loss's precision; float64 (tests) stays float64.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
