"""Static shapes for compiled and graph-captured steps: pad a batch's token and masked-row counts to buckets.

A training batch has a fixed number of sequences B but a varying token count T and masked count M, so every step
would have new shapes: `torch.compile(dynamic=False)` would recompile, and a CUDA graph (fixed addresses and sizes)
could not be replayed. `pad_to_buckets` appends K padding sequences that bring T up to the next multiple of
`token_bucket` (always at least one token each, so the sequence count is B + K for every batch; K = 1 for a bucket
of up to 512 tokens, `padding_sequences`) and appends padding masked rows up to the most that B sequences of that
many tokens can carry (`masked_rows_bound`), rounded to `masked_bucket`. So M is a function of T's bucket, and a
step takes one shape per token bucket: a CUDA graph per bucket, not per (T, M) pair. (Padded to its own bucket, M
took about two values per T bucket, and a 150-step H100 run with 512-token buckets kept meeting new (T, M) pairs and
recording graphs for them: 471 samples/s against 690 compiled without graphs; `bench/static_shapes.py` counts them.)
`likely_token_buckets` names the buckets a run will meet, so that the warm-up can record them all before `run_start`
(`bert.train.warmup`).

The padding changes neither the loss nor any gradient:
  - each padding sequence is its own segment in `cu_seqlens`, so no real token attends to it;
  - its masked rows carry the label `IGNORE` (-100), which the MLM loss and accuracy skip, and
    the MLM loss divides by the count of real labels;
  - each one's [CLS] row gets NSP label `IGNORE`, which the NSP mean skips.
Padding tokens are [PAD] (id 0), segment 0, position 0: any valid ids would do, since nothing of them
reaches the loss. Their cost is at most `token_bucket + K - 1` tokens through the dense layers and attention
segments of at most `SEQLEN_BOUND` tokens each: a bucket above it is split into several padding sequences, as
one padding sequence as long as the bucket would cost a quadratic attention segment of that length and, its length
differing from batch to batch, would set `max_seqlen`, which each CUDA graph bakes in (a recording per step). Keep
the bucket at most 512 on the GPU, or a few thousand when fewer shapes matter more (about 4 % more tokens at 2048
on the phase-2 mix, 8 % at 4096).
The extra masked rows (about B / 2 + 0.15 x the padding tokens) cost the MLM head well under 0.1 %.

The eval batches are padded the same way (`bert.data.eval_set`): the same shapes at every evaluation, each
known before the run from the eval set's lengths, so a CUDA-graph mode records them in the warm-up. Their bucket
is STATIC_TOKENS capped at one sequence's length (`eval_token_bucket`): an eval batch of 16 sequences holds about
4,000 tokens, and a 4,096-token bucket padded it by about half (`bench/static_shapes.py`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from bert.batch import Batch, SeqLayout
from bert.data.format import MASK_RATE

IGNORE = -100  # label skipped by the MLM and NSP losses (torch's cross_entropy ignore_index)
PAD_ID = 0  # [PAD] in the BERT vocabulary
SEQLEN_BOUND = 512  # max_seqlen of every padded batch (BERT's longest sequence): one value for every step
MASKED_BUCKET = 64  # masked rows are padded to a multiple of this (the driver's choice; ~76 per sequence at most)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def masked_rows_bound(tokens: int, sequences: int, rate: float = MASK_RATE) -> int:
    """The most masked positions `sequences` sequences of `tokens` tokens in all carry when each masks
    min(76, max(1, round(rate x its words))) of them, as create_pretraining_data does: at most
    rate x length + 1 per sequence."""
    return math.ceil(rate * tokens) + sequences


def padding_sequences(token_bucket: int, seqlen_bound: int = SEQLEN_BOUND) -> int:
    """K, the padding sequences `pad_to_buckets` appends: the fewest for which any padding it can need (K to
    token_bucket + K - 1 tokens, one at least per sequence) splits into sequences of at most `seqlen_bound` tokens.
    1 for a bucket up to the bound; 3 for 1024, 5 for 2048, 9 for 4096 at 512."""
    k = 1
    while -(-(token_bucket + k - 1) // k) > seqlen_bound:
        k += 1
    return k


def padded_tokens(tokens: int, token_bucket: int, seqlen_bound: int = SEQLEN_BOUND) -> int:
    """T after `pad_to_buckets`: the next multiple of `token_bucket` with a token for each padding sequence."""
    return round_up(tokens + padding_sequences(token_bucket, seqlen_bound), token_bucket)


def pad_to_buckets(batch: Batch, token_bucket: int, masked_bucket: int, seqlen_bound: int = SEQLEN_BOUND,
                   mask_rate: float = MASK_RATE) -> Batch:
    """`batch` plus K padding sequences (`padding_sequences`: T -> `padded_tokens`, the padding split as evenly as
    can be, none longer than `seqlen_bound`) and padding
    masked rows (M -> `masked_rows_bound` of the padded T and the real sequences, or M itself if more,
    rounded up to a multiple of `masked_bucket`; `mask_rate=0`: M's own bucket). Shapes come from the
    host: no device sync. `max_seqlen` is raised to `seqlen_bound` (an upper bound is all flash attention
    needs), so it is one more value that stays the same from batch to batch (a CUDA graph bakes it in)."""
    if token_bucket < 1 or masked_bucket < 1:
        raise ValueError(f"buckets must be positive, got token_bucket={token_bucket}, masked_bucket={masked_bucket}")
    tokens, masked = batch.num_tokens, batch.masked_labels.numel()
    k = padding_sequences(token_bucket, seqlen_bound)
    extra = padded_tokens(tokens, token_bucket, seqlen_bound) - tokens
    pieces = [extra // k + (i < extra % k) for i in range(k)]
    rows = max(masked, masked_rows_bound(tokens + extra, batch.num_sequences, mask_rate)) if mask_rate else masked
    extra_masked = round_up(rows, masked_bucket) - masked
    dev = batch.input_ids.device
    fill = lambda n, value, like: torch.full((n,), value, dtype=like.dtype, device=dev)  # noqa: E731
    seq = SeqLayout.from_lengths((*batch.seq.lengths, *pieces), device=batch.seq.cu_seqlens.device)
    seq = replace(seq, max_seqlen=max(seq.max_seqlen, seqlen_bound))
    return Batch(
        input_ids=torch.cat([batch.input_ids, fill(extra, PAD_ID, batch.input_ids)]),
        segment_ids=torch.cat([batch.segment_ids, fill(extra, 0, batch.segment_ids)]),
        position_ids=torch.cat([batch.position_ids, fill(extra, 0, batch.position_ids)]),
        seq=seq,
        # padding masked rows read the first padding token; their labels are ignored
        masked_positions=torch.cat([batch.masked_positions, fill(extra_masked, tokens, batch.masked_positions)]),
        masked_labels=torch.cat([batch.masked_labels, fill(extra_masked, IGNORE, batch.masked_labels)]),
        nsp_labels=torch.cat([batch.nsp_labels, fill(k, IGNORE, batch.nsp_labels)]),
    )


def pad_static(batch: Batch, static_tokens: int) -> Batch:
    """STATIC_TOKENS's padding (training, eval and warm-up batches alike): `pad_to_buckets` with the driver's
    masked-row bucket, or `batch` itself when `static_tokens` is 0 (off)."""
    return pad_to_buckets(batch, static_tokens, MASKED_BUCKET) if static_tokens else batch


def eval_token_bucket(static_tokens: int, max_seq_length: int = 512) -> int:
    """The eval batches' token bucket: STATIC_TOKENS, at most one sequence's length (0: off). Eval batches are small
    (EVAL_BATCHSIZE sequences) and their few shapes are recorded once, so a fine bucket costs little and saves
    the padding a coarse training bucket would add. A multiple of 16 either way when STATIC_TOKENS is (float8)."""
    return min(static_tokens, max_seq_length) if static_tokens else 0


def likely_token_buckets(lengths: np.ndarray, sequences: int, token_bucket: int, max_len: int = 512,
                         sigmas: float = 4.5) -> list[int]:
    """The padded token counts of batches of `sequences` samples drawn from `lengths`, within `sigmas`
    standard deviations of their mean (a sum of n draws: n x mean, sqrt(n) x sd; at 4.5 sigma about one
    batch in 150,000 falls outside, and costs one recording in the timed run), each a multiple of
    `token_bucket` that `pad_to_buckets` can reach (`padded_tokens`, T between 2 and max_len tokens per sequence)."""
    mean, sd = float(np.mean(lengths)), float(np.std(lengths))
    lo = max(2 * sequences, math.floor(sequences * mean - sigmas * math.sqrt(sequences) * sd))
    hi = min(max_len * sequences, math.ceil(sequences * mean + sigmas * math.sqrt(sequences) * sd))
    return list(range(padded_tokens(lo, token_bucket), padded_tokens(hi, token_bucket) + 1, token_bucket))


def bucket_batch(bucket: int, sequences: int, token_bucket: int, vocab_size: int, seed: int = 0,
                 max_len: int = 512) -> Batch:
    """A random batch of `sequences` sequences that `pad_to_buckets` brings to `bucket` tokens, with as many
    masked rows as a real batch there: for recording that bucket's graph before the run."""
    from bert.synthetic import random_batch  # the synthetic data are for benchmarks and warm-ups only

    k = padding_sequences(token_bucket)
    tokens = min(bucket - k - (token_bucket - 1) // 2, max_len * sequences)  # mid-bucket: T + K <= bucket
    if tokens < 2 * sequences or padded_tokens(tokens, token_bucket) != bucket:
        raise ValueError(f"no batch of {sequences} sequences of 2..{max_len} tokens pads to {bucket}")
    lengths = np.full(sequences, tokens // sequences)
    lengths[: tokens % sequences] += 1
    return random_batch(lengths, seed=seed, vocab_size=vocab_size)
