"""The unpadded model against its padded reference path on the same weights (float64), and its contract."""

import json

import pytest
import torch

from bert.batch import SeqLayout
from bert.model import BertConfig, BertForPreTraining
from bert.model.last_layer import kept_row_count
from bert.model.layers import Stream
from bert.model.padding import PadLayout, pad, unpad
from bert.synthetic import random_batch

BATCHES = {"one_token": (1,), "full_512": (512,), "mixed": (3, 1, 77, 260, 130, 385)}  # every length group


def tiny_model(attention="loop", dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return BertForPreTraining(BertConfig.load("tiny").with_dropout(dropout), attention=attention).double()


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES.keys())
def test_unpadded_equals_padded_logits_losses_and_every_gradient(lengths):
    model = tiny_model()
    batch = random_batch(lengths, seed=len(lengths))
    ref = model.forward_padded(batch)
    ref_grads = grads_of(model, ref.loss)
    out = model(batch)
    out_grads = grads_of(model, out.loss)

    for field in ("mlm_logits", "nsp_logits", "loss", "mlm_loss", "nsp_loss"):
        torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=0, atol=1e-12, msg=field)
    assert out.mlm_correct.item() == ref.mlm_correct.item()
    assert ref_grads.keys() == {n for n, _ in model.named_parameters()}  # every parameter gets a gradient
    assert out_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(out_grads[name], g, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", ("grouped", "padded"))
def test_every_backend_gives_the_padded_reference(backend):
    model = tiny_model(attention=backend)
    batch = random_batch(BATCHES["mixed"], seed=3)
    torch.testing.assert_close(model(batch).mlm_logits, model.forward_padded(batch).mlm_logits, rtol=0, atol=1e-12)


def test_padding_to_512_does_not_change_the_padded_reference():
    model = tiny_model()
    batch = random_batch((5, 70), seed=2)
    torch.testing.assert_close(model.forward_padded(batch, width=512).loss, model.forward_padded(batch).loss,
                               rtol=0, atol=1e-12)


def test_pad_layout_puts_each_chosen_sequence_in_its_row_and_refuses_a_width_too_small():
    """Lengths 3, 1, 4 (tokens 0-2, 3, 4-7); sequences 2 then 0 in rows of width 5, by hand."""
    seq = SeqLayout.from_lengths((3, 1, 4))
    layout = PadLayout.build(seq, sequences=[2, 0], width=5)
    assert layout.tokens.tolist() == [4, 5, 6, 7, 0, 1, 2] and layout.slots.tolist() == [0, 1, 2, 3, 5, 6, 7]
    assert layout.key_mask.tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    x = torch.arange(8.0) * 10
    assert pad(x, layout, value=-1).tolist() == [[40, 50, 60, 70, -1], [0, 10, 20, -1, -1]]
    assert unpad(pad(x, layout), layout).tolist() == [40, 50, 60, 70, 0, 10, 20]
    assert PadLayout.build(seq, width=4).key_mask.shape == (3, 4)  # the longest sequence fills its row exactly
    with pytest.raises(ValueError, match="a sequence of 4 tokens does not fit in width 3"):
        PadLayout.build(seq, width=3)


def test_losses_and_accuracy_follow_their_definitions():
    model = tiny_model()
    batch = random_batch(BATCHES["mixed"], seed=4)
    out = model(batch)
    mlm = torch.nn.functional.log_softmax(out.mlm_logits, -1)[torch.arange(len(batch.masked_labels)),
                                                               batch.masked_labels]
    torch.testing.assert_close(out.mlm_loss, -mlm.mean())
    nsp = torch.nn.functional.log_softmax(out.nsp_logits, -1)[torch.arange(batch.num_sequences), batch.nsp_labels]
    torch.testing.assert_close(out.nsp_loss, -nsp.mean())
    torch.testing.assert_close(out.loss, out.mlm_loss + out.nsp_loss)
    assert out.mlm_total.dtype == out.mlm_correct.dtype == torch.int64 and out.mlm_total.dim() == 0
    assert out.mlm_total.item() == len(batch.masked_labels) and out.mlm_logits.shape == (out.mlm_total.item(), 30522)
    assert out.mlm_correct.item() == int((out.mlm_logits.argmax(-1) == batch.masked_labels).sum())
    # Forcing the prediction to token 2000: every masked token right, or every one wrong.
    model.cls.predictions.bias.data[2000] = 1e6
    batch.masked_labels.fill_(2000)
    assert model(batch).mlm_correct.item() == len(batch.masked_labels)
    batch.masked_labels.fill_(2001)
    assert model(batch).mlm_correct.item() == 0


def test_padding_classes_take_no_part_in_loss_accuracy_or_gradients():
    """vocab_size 30528 = 30522 real tokens + 6 padding rows: whatever those rows hold, the outputs are
    those of the 30522-class model, no prediction is a padding class, and the rows get no gradient."""
    model = tiny_model()
    batch = random_batch(BATCHES["mixed"], seed=5)
    words, bias = model.bert.embeddings.word_embeddings.weight, model.cls.predictions.bias
    assert model.config.real_vocab_size == 30522 and words.shape[0] == bias.shape[0] == 30528
    with torch.no_grad():
        words[30522:] = 0
        bias[30522:] = 0
    ref = model(batch)
    ref_grads = grads_of(model, ref.loss)
    with torch.no_grad():  # padding rows that would win every softmax and every argmax if they took part
        words[30522:] = 50 * torch.randn_like(words[30522:])
        bias[30522:] = 1e6
    out = model(batch)
    out_grads = grads_of(model, out.loss)
    assert out.mlm_logits.shape[1] == 30522 and int(out.mlm_logits.argmax(-1).max()) < 30522
    for field in ("mlm_logits", "mlm_loss", "loss"):
        torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=0, atol=0, msg=field)
    assert out.mlm_correct.item() == ref.mlm_correct.item()
    for name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
        assert not out_grads[name][30522:].any() and out_grads[name][:30522].any(), name
        torch.testing.assert_close(out_grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    # Labels set to the best real class: every masked token right although a padding class scores 1e6.
    labels = batch.masked_labels.clone()
    batch.masked_labels.copy_(out.mlm_logits.argmax(-1))
    assert model(batch).mlm_correct.item() == len(labels)


def test_no_padded_tensor_in_the_unpadded_trunk_and_the_head_sees_only_masked_rows():
    """Every module of the trunk sees the T tokens, except the last layer after its attention, which keeps the
    [CLS] and masked rows (bert.model.last_layer), the pooler (B rows) and the MLM head (M rows)."""
    model = tiny_model()
    batch = random_batch(BATCHES["mixed"], seed=6)
    shapes = []
    last = f"bert.encoder.layer.{model.config.num_hidden_layers - 1}"
    modules = [(n, m) for n, m in model.named_modules() if n.startswith(("bert.embeddings.", "bert.encoder"))]
    modules += [("bert.pooler", model.bert.pooler), ("cls.predictions.transform", model.cls.predictions.transform)]
    # a sublayer's Stream is its output twice (bert.model.layers): the first stands for both
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: shapes.append((n, tuple((o.x if isinstance(o, Stream) else o)
                                                                                 .shape)))) for n, m in modules]
    model(batch)
    for h in hooks:
        h.remove()
    T, M, B = batch.num_tokens, len(batch.masked_labels), batch.num_sequences
    kept = kept_row_count(B, M)
    for name, shape in shapes:
        if name == "bert.pooler":
            assert shape == (B, 128)
        elif name == "cls.predictions.transform":
            assert shape == (M, 128)
        elif name in ("bert.encoder", last, f"{last}.attention") or name.startswith(
                (f"{last}.attention.output", f"{last}.intermediate", f"{last}.output")):
            assert shape[0] == kept and len(shape) == 2, (name, shape)
        else:
            assert shape[0] == T and len(shape) == 2, (name, shape)
    assert len(shapes) == len(modules) - 1  # every module ran once (the layer list itself is not called)


def test_dropout_is_active_in_train_mode_only():
    model = tiny_model(dropout=0.1)
    batch = random_batch((50, 20), seed=7)
    model.train()
    a, b = model(batch).mlm_logits, model(batch).mlm_logits
    assert (a - b).abs().max() > 1e-3
    model.eval()
    torch.testing.assert_close(model(batch).mlm_logits, model(batch).mlm_logits, rtol=0, atol=0)
    no_dropout = tiny_model(dropout=0.0).train()
    torch.testing.assert_close(no_dropout(batch).mlm_logits, no_dropout.eval()(batch).mlm_logits, rtol=0, atol=0)


def test_embedding_dropout_follows_the_layernorm():
    """Google's BERT: dropout(LayerNorm(word + position + segment)), so in training every output is 0 or the
    normalised sum (float64 here, with the config's eps 1e-12) divided by 1 - p."""
    model = tiny_model(dropout=0.5)
    emb = model.bert.embeddings
    batch = random_batch((20, 7), seed=5)
    assert set(batch.segment_ids.tolist()) == {0, 1}
    with torch.no_grad():
        x = (emb.word_embeddings.weight[batch.input_ids] + emb.position_embeddings.weight[batch.position_ids]
             + emb.token_type_embeddings.weight[batch.segment_ids])
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        want = (x - mean) / (var + 1e-12).sqrt() * emb.LayerNorm.weight + emb.LayerNorm.bias
        got = emb(batch.input_ids, batch.position_ids, batch.segment_ids)
    kept = got != 0
    assert 0.3 < kept.double().mean().item() < 0.7
    torch.testing.assert_close(got[kept], want[kept] / 0.5, rtol=0, atol=1e-12)


def test_bf16_autocast_is_close_to_fp32():
    model = tiny_model().float()
    batch = random_batch((3, 1, 77, 130), seed=8)
    ref = model(batch).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    assert out.mlm_logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref, rtol=2e-2, atol=0)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_config_from_google_json_pads_the_vocabulary(tmp_path):
    google = {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
              "max_position_embeddings": 512, "num_attention_heads": 16, "num_hidden_layers": 24,
              "type_vocab_size": 2, "vocab_size": 30522}  # MLPerf phase-1 bert_config.json
    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps(google))
    cfg = BertConfig.load(path)
    assert cfg.vocab_size == 30528 and cfg.real_vocab_size == 30522 and cfg.head_dim == 64
    assert cfg == BertConfig.load("large")
    path.write_text(json.dumps(cfg.to_dict()))  # our own JSON (checkpoint metadata) keeps both sizes
    assert BertConfig.load(path) == cfg
    assert BertConfig(vocab_size=64).real_vocab_size == 64  # no padding unless told
    with pytest.raises(ValueError, match="real_vocab_size 30529"):
        BertConfig(real_vocab_size=30529)
    with pytest.raises(ValueError, match="huge"):
        BertConfig.load("huge")
    for act in ("relu", "gelu_new", "gelu_pytorch_tanh"):  # HF's tanh approximations are not exact GELU
        path.write_text(json.dumps({**google, "hidden_act": act}))
        with pytest.raises(ValueError, match=f"hidden_act '{act}' is not supported"):
            BertConfig.load(path)
