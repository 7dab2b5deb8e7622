"""Static-shape padding (bert.static_shapes): the padded batch has bucketed shapes, and its loss and every
gradient equal the unpadded batch's, float64."""

from dataclasses import replace

import pytest
import torch

from bert.model import BertConfig, BertForPreTraining
from bert.static_shapes import IGNORE, pad_to_buckets
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


@pytest.mark.parametrize("attention", ("loop", "grouped"))
def test_padding_changes_neither_the_loss_nor_any_gradient(attention):
    torch.manual_seed(0)
    cfg = replace(BertConfig.load("tiny"), vocab_size=2000, real_vocab_size=1998).with_dropout(0.0)
    model = BertForPreTraining(cfg, attention=attention).double()
    batch = random_batch(LENGTHS, seed=3, vocab_size=1998)
    padded = pad_to_buckets(batch, token_bucket=256, masked_bucket=32)
    assert padded.masked_labels.numel() > batch.masked_labels.numel()  # some padding rows are really there

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
