"""The last-layer subset (bert.model.last_layer) against the full model and the padded model, in float64 on the CPU."""

import pytest
import torch

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model.last_layer import kept_row_count, kept_rows, split_kept
from bert.static_shapes import MASKED_BUCKET, pad_to_buckets
from bert.synthetic import random_batch
from bert.train.build import build_model

CFG = BertConfig(vocab_size=1064, real_vocab_size=1061, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                 intermediate_size=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LENGTHS = {"one": (9,), "mixed": (3, 1, 77, 260, 130, 45)}


def batch_of(name: str, static: bool = False):
    batch = random_batch(LENGTHS[name], seed=7, vocab_size=CFG.real_vocab_size)
    return pad_to_buckets(batch, 128, MASKED_BUCKET) if static else batch


def pair(attention: str) -> tuple[BertForPreTraining, BertForPreTraining]:
    """The same float64 weights with and without the subset, in training mode (dropout 0 in CFG)."""
    torch.manual_seed(0)
    subset = BertForPreTraining(CFG, attention=attention, last_layer_subset=True).double().train()
    full = BertForPreTraining(CFG, attention=attention, last_layer_subset=False).double().train()
    full.load_state_dict(subset.state_dict())
    return subset, full


def grads(model: BertForPreTraining, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["loop", "grouped", "padded"])
@pytest.mark.parametrize("name,static", [("one", False), ("mixed", False), ("mixed", True)])
def test_losses_and_every_gradient_equal_the_full_model(attention, name, static):
    batch = batch_of(name, static)
    subset, full = pair(attention)
    got, want = subset(batch), full(batch)
    for field in ("loss", "mlm_loss", "nsp_loss", "mlm_logits", "nsp_logits"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=1e-12, msg=field)
    assert (got.mlm_correct, got.mlm_total) == (want.mlm_correct, want.mlm_total)
    g_sub, g_full = grads(subset, got.loss), grads(full, want.loss)
    for p in g_full:
        torch.testing.assert_close(g_sub[p], g_full[p], rtol=0, atol=1e-12, msg=p)
    assert g_full["bert.encoder.layer.2.output.dense.weight"].abs().sum() > 0  # the last layer is trained


def test_the_padded_model_agrees():
    """An independent reference: the same weights on the zero-padded batch with a key mask, every row computed."""
    batch = batch_of("mixed")
    subset, _ = pair("loop")
    got, want = subset(batch), subset.forward_padded(batch)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.mlm_logits, want.mlm_logits, rtol=0, atol=1e-12)


def test_kept_rows_are_cls_then_masked_then_filler_to_a_multiple_of_16():
    batch = batch_of("mixed", static=True)
    rows = kept_rows(batch)
    b, m = batch.num_sequences, batch.masked_positions.numel()
    assert len(rows) == kept_row_count(b, m) and len(rows) % 16 == 0 and len(rows) >= b + m
    assert rows.dtype == torch.int64
    assert rows[:b].tolist() == batch.seq.cu_seqlens[:-1].tolist()
    assert rows[b:b + m].tolist() == batch.masked_positions.tolist()
    assert set(rows[b + m:].tolist()) <= {0}
    x = torch.randn(batch.num_tokens, 5)
    masked, cls = split_kept(x.index_select(0, rows), batch)
    assert torch.equal(masked, x[batch.masked_positions]) and torch.equal(cls, x[batch.seq.cu_seqlens[:-1].long()])


def test_the_last_layer_sees_only_the_kept_rows():
    """What makes it cheaper: the last layer's feed-forward gets R rows, every other layer T."""
    batch = batch_of("mixed")
    subset, _ = pair("loop")
    seen = {}
    for i, layer in enumerate(subset.bert.encoder.layer):
        layer.intermediate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0].shape[0]))
    subset(batch)
    T, R = batch.num_tokens, kept_row_count(batch.num_sequences, batch.masked_positions.numel())
    assert seen == {0: T, 1: T, 2: R} and R < T / 2


def test_last_layer_subset_is_chosen_in_the_config():
    model_cfg = lambda **kw: from_flat(bert_config_path="tiny", **kw).model  # noqa: E731
    assert model_cfg().last_layer_subset is True  # exact, so on by default
    assert build_model(model_cfg(last_layer_subset=False), torch.device("cpu")).last_layer_subset is False
    assert build_model(model_cfg(), torch.device("cpu")).last_layer_subset is True


@pytest.mark.parametrize("scope", ["model", "layers"])
def test_a_compiled_model_does_not_recompile_when_the_filler_is_empty_or_one_row(scope):
    """The filler after the [CLS] and masked rows is 0 to 15 rows; a dynamic graph specialises on sizes 0 and 1,
    so a filler tensor of its own recompiled the encoder twice inside the timed run (seen on the CPU under
    COMPILE=default, 2026-11-25). Batches of 4 sequences whose masked counts leave fillers of 6, 0, 1 and 11 rows
    run on the graphs of the first (COMPILE=debug: dynamo + AOT autograd, run eagerly). One layer, the last, and
    padded attention: the filler reaches only the last layer and the heads, and every batch has the same lengths,
    so more layers or the loop backend would add tracing, not graphs that could recompile."""
    import dataclasses

    from bert.model.compile import compile_model

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, num_hidden_layers=1)
    model = BertForPreTraining(cfg, attention="padded", last_layer_subset=True).train()
    compile_model(model, "debug", torch.device("cpu"), scope)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    base = random_batch((100, 80, 60, 120), seed=3, vocab_size=cfg.real_vocab_size)
    graphs, fillers = [], []
    for m in (6, 12, 11, 33):  # odd positions: no masked row is a [CLS] row, none repeats
        batch = dataclasses.replace(base, masked_positions=torch.arange(1, 2 * m, 2),
                                    masked_labels=torch.randint(0, cfg.real_vocab_size, (m,)))
        model(batch).loss.backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        fillers.append(kept_row_count(4, m) - 4 - m)
    assert fillers == [6, 0, 1, 11] and graphs == graphs[:1] * 4
