"""Static-shape padding (bert.static_shapes): the padded batch has bucketed shapes, and its loss and every
gradient equal the unpadded batch's, float64."""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bert.data.format import MASK_RATE
from bert.lengths import WIKI_PHASE2
from bert.model import BertConfig, BertForPreTraining
from bert.static_shapes import (
    IGNORE,
    MASKED_BUCKET,
    PAD_ID,
    bucket_batch,
    likely_token_buckets,
    masked_rows_bound,
    pad_to_buckets,
    padded_tokens,
    padding_sequences,
)
from bert.synthetic import random_batch

LENGTHS = (37, 5, 128, 2, 64, 90)  # 326 tokens


def test_padded_batch_has_bucketed_shapes_and_one_ignored_sequence():
    batch = random_batch(LENGTHS, seed=0)
    padded = pad_to_buckets(batch, token_bucket=128, masked_bucket=16)
    assert padded.num_tokens == 384 and padded.seq.lengths == (*LENGTHS, 384 - 326)
    assert padded.seq.max_seqlen == 512  # the bound, the same for every batch
    assert padded.seq.cu_seqlens.tolist() == [0, 37, 42, 170, 172, 236, 326, 384]
    assert padded.masked_labels.numel() % 16 == 0 and padded.masked_labels.numel() >= batch.masked_labels.numel()
    assert padded.nsp_labels.tolist() == [*batch.nsp_labels.tolist(), IGNORE]
    extra = padded.masked_labels.numel() - batch.masked_labels.numel()
    assert (padded.masked_labels[-extra:] == IGNORE).all() if extra else True
    assert (padded.masked_positions[batch.masked_labels.numel():] >= 326).all()  # only padding rows
    # a batch already on a bucket edge still gets its padding sequence: B + 1 sequences for every batch
    exact = pad_to_buckets(random_batch((64, 64), seed=1), token_bucket=128, masked_bucket=1)
    assert exact.num_tokens == 256 and exact.num_sequences == 3
    with pytest.raises(ValueError, match="token_bucket=0"):
        pad_to_buckets(batch, 0, 8)
    # a bucket above the bound: the padding in K = 3 sequences of at most 512 tokens, max_seqlen still the bound
    wide = pad_to_buckets(random_batch((100, 20), seed=2), token_bucket=1024, masked_bucket=8)
    assert wide.seq.lengths == (100, 20, 302, 301, 301) and wide.seq.max_seqlen == 512
    assert wide.nsp_labels.tolist()[2:] == [IGNORE] * 3
    # a real sequence longer than the bound (a larger MAX_SEQ_LENGTH) keeps max_seqlen an upper bound of every one
    assert pad_to_buckets(random_batch((600, 20), seed=3), token_bucket=128, masked_bucket=8).seq.max_seqlen == 600


def padding_by_hand(tokens: int, bucket: int, bound: int = 512) -> list[int]:
    """The padding split into the fewest sequences of 1..bound tokens for which every T has room, by search."""
    for k in range(1, bucket + 2):
        extras = [-(-(t + k) // bucket) * bucket - t for t in range(bucket)]  # every T mod bucket
        if all(k <= e <= k * bound for e in extras):
            extra = -(-(tokens + k) // bucket) * bucket - tokens
            return sorted([extra // k + (i < extra % k) for i in range(k)], reverse=True)
    raise AssertionError


@pytest.mark.parametrize("bucket", [64, 512, 513, 1024, 2048, 4096])
def test_the_padding_never_raises_max_seqlen_and_keeps_one_sequence_count_per_bucket(bucket):
    """A CUDA graph bakes in max_seqlen and the sequence count: neither may follow the batch. The padding takes K
    sequences (K fixed by the bucket), each of 1..512 tokens, K the fewest that fit the largest padding there is."""
    assert padding_sequences(bucket) == len(padding_by_hand(0, bucket))
    counts = set()
    for t, lengths in enumerate([(5,), (511, 2), (512, 512, 512), (300,) * 9, (2,) * 40, (512,) * 8]):
        batch = random_batch(lengths, seed=t)
        padded = pad_to_buckets(batch, bucket, MASKED_BUCKET)
        pieces = padded.seq.lengths[len(lengths):]
        assert padded.num_tokens % bucket == 0 and padded.num_tokens == padded_tokens(batch.num_tokens, bucket)
        assert sorted(pieces, reverse=True) == padding_by_hand(batch.num_tokens, bucket), (lengths, pieces)
        assert max(pieces) <= 512 and min(pieces) >= 1 and padded.seq.max_seqlen == 512
        counts.add(len(pieces))
    assert counts == {padding_sequences(bucket)}


@pytest.mark.parametrize("attention, bucket", [("loop", 256), ("grouped", 256), ("loop", 1024)])
def test_padding_changes_neither_the_loss_nor_any_gradient(attention, bucket):
    torch.manual_seed(0)
    cfg = replace(BertConfig.load("tiny"), vocab_size=2000, real_vocab_size=1998).with_dropout(0.0)
    model = BertForPreTraining(cfg, attention=attention).double()
    batch = random_batch(LENGTHS, seed=3, vocab_size=1998)
    padded = pad_to_buckets(batch, token_bucket=bucket, masked_bucket=32)
    assert padded.masked_labels.numel() > batch.masked_labels.numel()  # some padding rows are really there
    assert padded.num_sequences == len(LENGTHS) + padding_sequences(bucket)  # 1024: three padding sequences

    def loss_and_grads(b):
        model.zero_grad(set_to_none=True)
        out = model(b)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(batch)
    got, got_grads = loss_and_grads(padded)
    for field in ("loss", "mlm_loss", "nsp_loss"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=1e-13, msg=field)
    assert (got.mlm_correct, got.mlm_total) == (want.mlm_correct, want.mlm_total)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-13, msg=name)
    # The padding rows' label is IGNORE (-100), which no prediction equals, whatever the model predicts; here it
    # predicts [PAD] (id 0, the padding tokens' id) everywhere, and the counts still ignore the padding rows.
    with torch.no_grad():
        model.cls.predictions.bias[PAD_ID] = 1e3
        want, got = model(batch), model(padded)
    assert int(got.mlm_correct) == int(want.mlm_correct) == int((batch.masked_labels == PAD_ID).sum())
    assert int(got.mlm_total) == int(want.mlm_total) == batch.masked_labels.numel()


def draws(n_batches: int, sequences: int, seed: int = 0):
    """Batches of the phase-2 length mix, masked as create_pretraining_data masks (bert.synthetic)."""
    rng = np.random.default_rng(seed)
    return [random_batch(WIKI_PHASE2.sample(sequences, rng), seed=i) for i in range(n_batches)]


def test_masked_rows_follow_the_token_bucket_so_each_bucket_is_one_shape():
    """Every batch padded to a token bucket gets the same masked-row count (one CUDA graph per bucket), and
    no real masked row is lost; padding M to its own bucket instead gives several shapes per bucket."""
    batches = draws(80, 24)
    shapes, own = {}, {}
    for b in batches:
        padded = pad_to_buckets(b, 512, MASKED_BUCKET)
        assert padded.masked_labels.numel() >= b.masked_labels.numel()
        assert padded.masked_labels.numel() >= masked_rows_bound(padded.num_tokens, b.num_sequences)
        shapes.setdefault(padded.num_tokens, set()).add(padded.masked_labels.numel())
        old = pad_to_buckets(b, 512, MASKED_BUCKET, mask_rate=0)
        own.setdefault(old.num_tokens, set()).add(old.masked_labels.numel())
    assert all(len(m) == 1 for m in shapes.values()), shapes
    assert any(len(m) > 1 for m in own.values())  # the draws do separate the two rules


def test_likely_buckets_cover_the_runs_batches_and_warm_up_batches_match_their_shapes():
    lengths = WIKI_PHASE2.sample(50_000, np.random.default_rng(1))
    buckets = likely_token_buckets(lengths, 32, 512)
    assert buckets == sorted(buckets) and all(b % 512 == 0 for b in buckets)
    assert len(buckets) <= 9 * np.sqrt(32) * lengths.std() / 512 + 2  # +-4.5 sd of a sum of 32 lengths
    real = {}
    for b in draws(150, 32, seed=2):
        padded = pad_to_buckets(b, 512, MASKED_BUCKET)
        real[padded.num_tokens] = padded.masked_labels.numel()
    assert set(real) <= set(buckets), (sorted(real), buckets)
    for bucket in buckets:
        warm = pad_to_buckets(bucket_batch(bucket, 32, 512, vocab_size=30522), 512, MASKED_BUCKET)
        assert warm.num_tokens == bucket and warm.num_sequences == 33 and warm.seq.max_seqlen == 512
        assert warm.masked_labels.numel() == real.get(bucket, warm.masked_labels.numel())
    with pytest.raises(ValueError, match="pads to 512"):
        bucket_batch(512, 300, 512, vocab_size=30522)  # 300 sequences of 2 tokens or more do not fit in 511


def test_likely_buckets_by_hand():
    """Lengths 100 and 300 (mean 200, sd 100), batches of 4: the token count T of a batch lies in 800 +- 4.5 x 2 x 100,
    cut to what 4 sequences of 2..512 tokens can hold, [8, 1700]; padded (T + 1 at least) to 512-token buckets that
    is 512, 1024, 1536 and 2048, the last one included. One length (sd 0): the one bucket of 4 x 100 + 1 tokens."""
    lengths = np.array([100, 300] * 50)
    assert likely_token_buckets(lengths, 4, 512) == [512, 1024, 1536, 2048]
    assert likely_token_buckets(lengths, 4, 512, sigmas=1.0) == [1024]  # T in [600, 1000]
    assert likely_token_buckets(np.full(7, 100), 4, 128) == [512]
    assert likely_token_buckets(np.full(7, 127), 1, 128) == [128]  # 127 + 1: the last bucket still in the range


def test_shape_count_bench_table_and_json(tmp_path, capsys):
    """bench/static_shapes.py: with M tied to T and the warm-up's buckets no shape is new in the timed steps;
    with M in its own bucket some are (the H100 CUDA-graph run's slowdown)."""
    from script_modules import load_script

    bench = load_script("bench/static_shapes.py")
    out = tmp_path / "shapes.json"
    assert bench.main(["--buckets", "512", "--batch", "48", "--steps", "60", "--seeds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    own, tied = report["rows"]
    assert (own["masked_rule"], tied["masked_rule"]) == bench.RULES
    assert tied["warmed_new"] == 0 < own["timed_new"] and tied["shapes"] < own["shapes"]
    # the eval: 10,000 samples over 8 GPUs in batches of 16 are 79 batches on rank 0 (1250 samples), nearly every
    # one a shape of its own unpadded; padded, a handful
    one, eight = report["eval"]
    assert (one["batches"], eight["batches"]) == (625, 79)
    assert eight["padded"] < 15 < 70 < eight["unpadded"] <= 79 and 0 < eight["token_waste"] < 0.1
    assert eight["eval_bucket"] == 512 and eight["padded_to_static_tokens"] == eight["padded"]
    assert "timed_new" in capsys.readouterr().out


def test_eval_bucket_is_static_tokens_capped_at_one_sequence():
    """An eval batch of 16 holds ~4,000 tokens: a 4,096 bucket would pad it by half; capped at 512 the eval pays
    at most 511 tokens a batch (as STATIC_TOKENS=512 does), and off stays off."""
    from script_modules import load_script

    from bert.static_shapes import eval_token_bucket

    assert [eval_token_bucket(n) for n in (0, 128, 512, 4096)] == [0, 128, 512, 512]
    assert eval_token_bucket(4096, max_seq_length=128) == 128
    row = load_script("bench/static_shapes.py").eval_row(4096, 16, 10_000, 8, seeds=1)
    assert row["eval_bucket"] == 512 and row["token_waste"] < 0.1 < 0.3 < row["token_waste_at_static_tokens"]


def test_driver_pads_eval_batches_to_the_capped_bucket(world_of_one, one_thread, tmp_path):
    """The run the driver builds at STATIC_TOKENS=1024 pads training batches to 1024 and eval batches to 512."""
    from script_modules import load_script

    hs = load_script("bench/host_syncs.py")
    data = hs.write_random_shards(tmp_path / "data", eval_samples=40)
    run = hs.build(hs.config(data, tmp_path / "run", {"static_tokens": 1024, "num_eval_examples": 40}, max_steps=2))
    try:
        assert run.eval_set.static_tokens == 512
        tokens = [b.num_tokens for b in run.eval_set]
        assert all(t % 512 == 0 for t in tokens) and any(t % 1024 for t in tokens)  # not padded to 1024
        assert next(iter(run.loader)).num_tokens % 1024 == 0
    finally:
        run.loader.close()
        run.progress.close()


def test_masked_rows_bound_holds_for_the_data_generators_worst_batches():
    """The bound against the rule the shards were made with (`data/pretraining_instances.masked_count`, Google's
    round(15 %), at least one): batches of B sequences of one length, every length up to 512, which is where the
    rounding adds most per sequence. Were the bound under a real batch's count, batches of one token bucket could
    take two masked-row shapes, and a CUDA graph would be recorded inside the timed run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from pretraining_instances import PretrainingConfig, masked_count

    cfg = PretrainingConfig()
    assert cfg.masked_lm_prob == MASK_RATE
    for sequences in (1, 16, 96):
        for n in range(4, 513):
            bound, real = masked_rows_bound(sequences * n, sequences), sequences * masked_count(n, cfg)
            assert real <= bound, (sequences, n, real, bound)
    # The rounding's part is needed: 15 % of the tokens alone is short by half a row per 10-token sequence.
    assert 96 * masked_count(10, cfg) > math.ceil(MASK_RATE * 96 * 10)


def test_eval_batch_shapes_are_the_shapes_the_padding_makes():
    """`batch_shapes` names the eval's shapes from the length index, for the warm-up to record each before the clock
    starts; it must agree with what `pad_static` does to the batches, also where a batch's tokens are an exact
    multiple of the bucket (the padding sequence then adds a whole bucket: it is never empty)."""
    from bert.data.eval_set import batch_shapes
    from bert.static_shapes import pad_static

    lengths = np.array([64, 64, 100, 28, 128, 5, 7, 116, 256, 256, 30])  # pairs of 128, 128, 133, 123, 512, 30
    for bucket in (64, 128, 512):
        made = [(len(part), pad_static(random_batch(part, seed=0), bucket).num_tokens)
                for part in (lengths[i : i + 2] for i in range(0, len(lengths), 2))]
        assert batch_shapes(lengths, 2, bucket) == made, bucket
    assert batch_shapes(lengths, 2, 0) == [(2, 128), (2, 128), (2, 133), (2, 123), (2, 512), (1, 30)]
