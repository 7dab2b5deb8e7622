"""Last-layer subset (`LAST_LAYER_SUBSET`): the last encoder layer runs its row-wise part on the rows the losses read.

Pre-training reads two kinds of rows of the encoder's output: each sequence's [CLS] row (the pooler and NSP) and
the masked rows (the MLM head). Every other row of the last layer is computed and thrown away. The last layer's
attention still needs every token, as a key and value of the kept rows' queries; after attention the layer works
row by row (output projection, dropout, residual, LayerNorm, feed-forward, LayerNorm), so from there it runs on
the kept rows only. HazyResearch's MLPerf v2.0 BERT submission runs its last layer on the masked tokens
([HazyResearch-BERT], `--last_layer_subset`). Here every attention backend runs unchanged, on all queries:
cutting the queries as well would save about an eighth more (the Q projection and the attention products), at
the price of a second sequence layout (one for queries, one for keys) in every backend.

What it saves: in phase 2 about 15 % of the tokens are masked, so the last layer's output projection and
feed-forward (9 of its 12 h x h matmul units per row) see about 0.16 x T rows instead of T: for BERT-large about
0.63 of one of its 24 layers, 2.45 % of the step's matmul FLOPs on the phase-2 length mix at 48 or 96 sequences
(`bert.model.flops` counts it), and the same share of the layer's LayerNorm, dropout and GELU passes. Exact: the rows
left out get no gradient in the full model either (the losses do not read them), so losses and every gradient are
the full model's (tests/test_last_layer.py, float64). With dropout the last layer draws fewer random numbers, so
its masks differ from the full model's under the same seed: the same distribution, not the same draws.

The kept rows are the [CLS] rows, then the masked rows, then copies of row 0 up to a multiple of 16: the float8
weight-gradient GEMM's inner dimension is the row count (`bert.model.fp8`), and a static-shape batch
(`bert.static_shapes`) keeps a static count. All of it is device indexing sized from host numbers: no sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.batch import Batch
from bert.model.fp8 import ALIGN
from bert.static_shapes import round_up


def kept_row_count(sequences: int, masked: int) -> int:
    """How many rows the last layer keeps for a batch of `sequences` sequences and `masked` masked rows."""
    return round_up(sequences + masked, ALIGN)


def kept_rows(batch: Batch) -> Tensor:
    """Token indices of the kept rows, in `masked_positions`' dtype: the [CLS] rows, the masked rows, then row 0."""
    b, m = batch.num_sequences, batch.masked_positions.numel()
    cls_rows = batch.seq.cu_seqlens[:-1].to(batch.masked_positions.dtype)
    # Written into zeros rather than concatenated with a filler tensor: the filler's length is 0 or 1 for some
    # batches, sizes a dynamic graph specialises on, so under COMPILE each would recompile inside the timed run
    rows = batch.masked_positions.new_zeros(kept_row_count(b, m))
    rows[:b + m] = torch.cat([cls_rows, batch.masked_positions])
    return rows


def split_kept(x: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """The last layer's kept rows split into (masked rows, [CLS] rows), the order `heads` takes them in."""
    b, m = batch.num_sequences, batch.masked_positions.numel()
    return x[b:b + m], x[:b]
