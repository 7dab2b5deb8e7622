"""Static shapes for compiled and graph-captured steps: pad a batch's token and masked-row counts to buckets.

A training batch has a fixed number of sequences B but a varying token count T and masked count M, so
every step would have new shapes: `torch.compile(dynamic=False)` would recompile, and a CUDA graph
(fixed addresses and sizes) could not be replayed. `pad_to_buckets` appends one padding sequence that
brings T up to the next multiple of `token_bucket` (always at least one token, so the sequence count
is B + 1 for every batch) and appends padding masked rows up to the next multiple of `masked_bucket`.
With B fixed, the step then takes one of a few (T, M) shapes.

The padding changes neither the loss nor any gradient:
  - the padding sequence is its own segment in `cu_seqlens`, so no real token attends to it;
  - its masked rows carry the label `IGNORE` (-100), which the MLM loss and accuracy skip, and
    the MLM loss divides by the count of real labels;
  - its [CLS] row gets NSP label `IGNORE`, which the NSP mean skips.
Padding tokens are [PAD] (id 0), segment 0, position 0: any valid ids would do, since nothing of them
reaches the loss. Their cost is at most `token_bucket - 1` tokens through the dense layers and one
extra attention segment of that length (quadratic): keep the bucket at most 512 on the GPU.

The eval does not pad: it runs the unpadded eval batches (the same shapes at every evaluation, under
`torch.no_grad`) through the same model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bert.batch import Batch, SeqLayout

IGNORE = -100  # label skipped by the MLM and NSP losses (torch's cross_entropy ignore_index)
PAD_ID = 0  # [PAD] in the BERT vocabulary
MASKED_BUCKET = 64  # masked rows are padded to a multiple of this (the driver's choice; ~76 per sequence at most)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_to_buckets(batch: Batch, token_bucket: int, masked_bucket: int, seqlen_bound: int = 512) -> Batch:
    """`batch` plus one padding sequence (T -> a multiple of `token_bucket`, at least T + 1) and padding
    masked rows (M -> a multiple of `masked_bucket`). Shapes come from the host: no device sync.
    `max_seqlen` is raised to `seqlen_bound` (an upper bound is all flash attention needs), so it is one
    more value that stays the same from batch to batch (a CUDA graph bakes it in)."""
    if token_bucket < 1 or masked_bucket < 1:
        raise ValueError(f"buckets must be positive, got token_bucket={token_bucket}, masked_bucket={masked_bucket}")
    tokens, masked = batch.num_tokens, batch.masked_labels.numel()
    extra = round_up(tokens + 1, token_bucket) - tokens
    extra_masked = round_up(masked, masked_bucket) - masked
    dev = batch.input_ids.device
    fill = lambda n, value, like: torch.full((n,), value, dtype=like.dtype, device=dev)  # noqa: E731
    seq = SeqLayout.from_lengths((*batch.seq.lengths, extra), device=batch.seq.cu_seqlens.device)
    seq = replace(seq, max_seqlen=max(seq.max_seqlen, seqlen_bound))
    return Batch(
        input_ids=torch.cat([batch.input_ids, fill(extra, PAD_ID, batch.input_ids)]),
        segment_ids=torch.cat([batch.segment_ids, fill(extra, 0, batch.segment_ids)]),
        position_ids=torch.cat([batch.position_ids, fill(extra, 0, batch.position_ids)]),
        seq=seq,
        # padding masked rows read the first padding token; their labels are ignored
        masked_positions=torch.cat([batch.masked_positions, fill(extra_masked, tokens, batch.masked_positions)]),
        masked_labels=torch.cat([batch.masked_labels, fill(extra_masked, IGNORE, batch.masked_labels)]),
        nsp_labels=torch.cat([batch.nsp_labels, fill(1, IGNORE, batch.nsp_labels)]),
    )
