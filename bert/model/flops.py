"""Matmul FLOPs of a BERT pre-training step, from the batch's shape alone (host numbers, no device sync).

The one FLOP formula of the project: the progress line's `tflops=`/`mfu=` and `bench/model.py` use it.
It counts every matrix product of the model as 2*m*n*k (a multiply and an add per term), per layer:

    encoder layer   Q, K, V and output projections: 4 x 2*T*h*h; feed-forward: 2 x 2*T*h*i;
                    attention scores Q.K^T and context P.V: 2 x 2*h*pairs, pairs = sum of len^2;
                    under the last-layer subset (`last_layer.py`) the last layer's output projection and
                    feed-forward see its R kept rows instead of T
    pooler + NSP    2*B*h*h + 2*B*h*2 ([CLS] row of each sequence)
    MLM head        transform 2*M*h*h, decoder 2*M*h*vocab_size over the M masked rows only; the
                    decoder computes the padded vocabulary (the padding columns are sliced off after)

with T tokens, B sequences, M masked positions, hidden h, intermediate i. Training is 3x the forward:
the backward of each product is two products of the same size (input and weight gradients, or both
operands for the attention products). Not counted: embedding lookups and their gradient, bias adds,
LayerNorm, GELU, tanh, softmax, dropout, the losses and the optimizer (elementwise or per-row work,
a few FLOPs per element where a matmul does 2*h or more); nor the recomputation some attention
kernels (flash) do in the backward. These are model FLOPs, the numerator of MFU ("model FLOPs
utilisation", PaLM, Chowdhery et al. 2022), which also drops the non-matmul terms;
tests/test_flops.py checks the count against torch's FlopCounterMode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bert.batch import Batch
from bert.model.config import BertConfig
from bert.model.last_layer import kept_row_count

BACKWARD_FACTOR = 3  # forward + backward = 3 x forward, for matmuls


@dataclass(frozen=True)
class StepShape:
    """The sizes the model's matmuls see in one forward."""

    tokens: int  # rows through the encoder's linear layers (T unpadded, B*L padded)
    attention_pairs: int  # (query, key) pairs scored, over all sequences (sum of len^2 unpadded)
    sequences: int  # rows through the pooler and the NSP classifier (B)
    head_rows: int  # rows through the MLM head (M masked positions; every token for HF's head)
    last_rows: int | None = None  # rows through the last layer after its attention (R kept rows); None: `tokens`

    @classmethod
    def unpadded(cls, lengths: Sequence[int], masked: int, last_layer_subset: bool = True) -> StepShape:
        """A batch of sequences of `lengths` with `masked` masked positions, as `BertForPreTraining` runs it."""
        lengths = [int(n) for n in lengths]
        kept = kept_row_count(len(lengths), int(masked)) if last_layer_subset else None
        return cls(sum(lengths), sum(n * n for n in lengths), len(lengths), int(masked), kept)

    @classmethod
    def of_batch(cls, batch: Batch, last_layer_subset: bool = True) -> StepShape:
        """From the batch's host-side lengths and its label count (a shape): no device sync."""
        return cls.unpadded(batch.seq.lengths, batch.masked_labels.numel(), last_layer_subset)


def forward_flops_by_part(cfg: BertConfig, shape: StepShape) -> dict[str, int]:
    """Matmul FLOPs of one forward, by part of the model (their sum is `forward_flops`)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    t, pairs, b, m = shape.tokens, shape.attention_pairs, shape.sequences, shape.head_rows
    rows = (layers - 1) * t + (t if shape.last_rows is None else shape.last_rows)  # after attention, all layers
    return {
        "qkv_projections": layers * 3 * 2 * t * h * h,
        "attention_scores": layers * 2 * pairs * h,  # per head: pairs x head_dim; heads x head_dim = h
        "attention_context": layers * 2 * pairs * h,
        "attention_output": 2 * rows * h * h,
        "feed_forward": 2 * 2 * rows * h * i,
        "pooler": 2 * b * h * h,
        "nsp_classifier": 2 * b * h * 2,
        "mlm_transform": 2 * m * h * h,
        "mlm_decoder": 2 * m * h * cfg.vocab_size,
    }


def forward_flops(cfg: BertConfig, shape: StepShape) -> int:
    return sum(forward_flops_by_part(cfg, shape).values())


def train_flops(cfg: BertConfig, shape: StepShape) -> int:
    """Matmul FLOPs of one forward + backward (see the module docstring for what is counted)."""
    return BACKWARD_FACTOR * forward_flops(cfg, shape)


def batch_train_flops(cfg: BertConfig, batch: Batch, last_layer_subset: bool = True) -> int:
    """`train_flops` of one unpadded batch as the model runs it."""
    return train_flops(cfg, StepShape.of_batch(batch, last_layer_subset))
