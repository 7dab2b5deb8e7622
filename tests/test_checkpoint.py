"""Checkpoint save/load, bad checkpoints, and the TF name mapping (without TensorFlow)."""


import pytest
import torch
from safetensors.torch import load_file, save_file
from script_modules import load_script

from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import export_state, load_pretrained, load_state, load_weights, save_weights, to_our_name
from bert.synthetic import random_batch

convert_tf = load_script("data/convert_tf_checkpoint.py")

WORDS = "bert.embeddings.word_embeddings.weight"


def tiny(seed):
    torch.manual_seed(seed)
    return BertForPreTraining(BertConfig.load("tiny").with_dropout(0.0), attention="loop").eval()


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


def test_save_and_load_roundtrip(tmp_path):
    src, dst = tiny(0), tiny(1)
    save_weights(src, tmp_path / "w.safetensors")
    loaded = load_weights(dst, tmp_path / "w.safetensors")
    assert len(loaded) == len(src.state_dict())
    assert_same_weights(src, dst)
    batch = random_batch((30, 9), seed=0)
    torch.testing.assert_close(dst(batch).loss, src(batch).loss, rtol=0, atol=0)


def test_nvidia_style_pt_with_module_prefix_loads(tmp_path):
    """NVIDIA's checkpoints: HF names with separate query/key/value under `module.`, wrapped in {"model": ...},
    the decoder stored too (a state_dict lists a tied tensor under both names)."""
    src, dst = tiny(0), tiny(1)
    state = export_state(src, real_vocab=False)
    assert "bert.encoder.layer.0.attention.self.value.weight" in state
    state["cls.predictions.decoder.weight"] = state[WORDS]
    torch.save({"model": {"module." + k: v for k, v in state.items()}}, tmp_path / "ckpt.pt")
    load_pretrained(dst, tmp_path / "ckpt.pt")
    assert_same_weights(src, dst)


def test_fused_qkv_holds_query_key_value_in_order_and_export_import_is_exact(tmp_path):
    src, dst = tiny(0), tiny(1)
    state = export_state(src, real_vocab=False)
    qkv = src.bert.encoder.layer[1].attention.self.qkv
    h = src.config.hidden_size
    for i, part in enumerate(("query", "key", "value")):  # each source tensor is one known slice
        assert torch.equal(state[f"bert.encoder.layer.1.attention.self.{part}.weight"], qkv.weight[i * h:(i + 1) * h])
        assert torch.equal(state[f"bert.encoder.layer.1.attention.self.{part}.bias"], qkv.bias[i * h:(i + 1) * h])
    assert not any(".qkv." in name for name in state)
    assert len(state) == len(src.state_dict()) + 4 * src.config.num_hidden_layers  # 2 tensors become 6 per layer
    load_state(dst, state, pad_vocab_rows=False)
    assert_same_weights(src, dst)


def test_our_older_files_with_separate_qkv_still_load(tmp_path):
    """Before the fusion, save_weights wrote query/key/value separately: such a file loads unchanged."""
    src, dst = tiny(0), tiny(1)
    save_file(export_state(src, real_vocab=False), str(tmp_path / "old.safetensors"))
    load_weights(dst, tmp_path / "old.safetensors")
    assert_same_weights(src, dst)
    batch = random_batch((30, 9), seed=0)
    torch.testing.assert_close(dst(batch).loss, src(batch).loss, rtol=0, atol=0)


def test_partial_or_doubled_qkv_is_named():
    state = export_state(tiny(0), real_vocab=False)
    del state["bert.encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layer\.1\.attention\.self\.key\.bias"):
        load_state(tiny(1), state, pad_vocab_rows=False)
    state = export_state(tiny(0), real_vocab=False)
    state["bert.encoder.layer.0.attention.self.qkv.weight"] = tiny(0).state_dict()[
        "bert.encoder.layer.0.attention.self.qkv.weight"]
    with pytest.raises(ValueError, match=r"both bert\.encoder\.layer\.0\.attention\.self\.qkv\.weight"):
        load_state(tiny(1), state, pad_vocab_rows=False)
    state = export_state(tiny(0), real_vocab=False)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    state[name] = state[name][:7]
    with pytest.raises(ValueError, match=r"layer\.0\.attention\.self: query/key/value\.weight shapes differ"):
        load_state(tiny(1), state, pad_vocab_rows=False)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "w.safetensors"
    save_weights(tiny(0), path)
    return path, load_file(str(path))


def rewrite(path, state):
    save_file(state, str(path))
    return path


def test_missing_tensor_is_named(saved):
    path, state = saved
    del state["bert.encoder.layer.1.attention.self.qkv.bias"]
    with pytest.raises(ValueError, match=r"layer\.1\.attention\.self\.qkv\.bias"):
        load_pretrained(tiny(1), rewrite(path, state))


def test_misshaped_tensor_is_named(saved):
    path, state = saved
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    state[name] = state[name][:500].clone()
    with pytest.raises(ValueError, match=r"layer\.0\.intermediate\.dense\.weight.*\(500, 128\)"):
        load_pretrained(tiny(1), rewrite(path, state))


def test_wrong_vocab_size_is_named(saved):
    path, state = saved
    state[WORDS] = state[WORDS][:30000].clone()
    with pytest.raises(ValueError, match="word_embeddings.*30000"):
        load_pretrained(tiny(1), rewrite(path, state))


def test_unexpected_tensor_is_named(saved):
    path, state = saved
    state["bert.encoder.layer.7.output.dense.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"layer\.7"):
        load_pretrained(tiny(1), rewrite(path, state))


def test_unpadded_vocab_is_zero_padded_but_not_in_our_own_format(saved):
    path, state = saved
    state[WORDS] = state[WORDS][:30522].clone()
    state["cls.predictions.bias"] = state["cls.predictions.bias"][:30522].clone()
    model = tiny(1)
    load_pretrained(model, rewrite(path, state))
    words = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(words[:30522], state[WORDS]) and not words[30522:].any()
    assert not model.cls.predictions.bias[30522:].any()
    with pytest.raises(ValueError, match="word_embeddings"):
        load_weights(tiny(1), path)


# Google BERT's TF variable names (as in model.ckpt-28252) and the HF names they correspond to.
TF_LAYER = {
    "attention/self/query/kernel": "attention.self.query.weight",
    "attention/self/query/bias": "attention.self.query.bias",
    "attention/self/key/kernel": "attention.self.key.weight",
    "attention/self/key/bias": "attention.self.key.bias",
    "attention/self/value/kernel": "attention.self.value.weight",
    "attention/self/value/bias": "attention.self.value.bias",
    "attention/output/dense/kernel": "attention.output.dense.weight",
    "attention/output/dense/bias": "attention.output.dense.bias",
    "attention/output/LayerNorm/gamma": "attention.output.LayerNorm.weight",
    "attention/output/LayerNorm/beta": "attention.output.LayerNorm.bias",
    "intermediate/dense/kernel": "intermediate.dense.weight", "intermediate/dense/bias": "intermediate.dense.bias",
    "output/dense/kernel": "output.dense.weight", "output/dense/bias": "output.dense.bias",
    "output/LayerNorm/gamma": "output.LayerNorm.weight", "output/LayerNorm/beta": "output.LayerNorm.bias",
}
TF_OTHER = {
    "bert/embeddings/word_embeddings": WORDS,
    "bert/embeddings/position_embeddings": "bert.embeddings.position_embeddings.weight",
    "bert/embeddings/token_type_embeddings": "bert.embeddings.token_type_embeddings.weight",
    "bert/embeddings/LayerNorm/gamma": "bert.embeddings.LayerNorm.weight",
    "bert/embeddings/LayerNorm/beta": "bert.embeddings.LayerNorm.bias",
    "bert/pooler/dense/kernel": "bert.pooler.dense.weight", "bert/pooler/dense/bias": "bert.pooler.dense.bias",
    "cls/predictions/transform/dense/kernel": "cls.predictions.transform.dense.weight",
    "cls/predictions/transform/dense/bias": "cls.predictions.transform.dense.bias",
    "cls/predictions/transform/LayerNorm/gamma": "cls.predictions.transform.LayerNorm.weight",
    "cls/predictions/transform/LayerNorm/beta": "cls.predictions.transform.LayerNorm.bias",
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",  # stored (2, hidden): no transpose
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
}


def fake_tf_variables(model):
    """The TF checkpoint `model` would come from: Google's names, kernels stored (in, out), vocab 30522."""
    ours = export_state(model, real_vocab=False)
    names = dict(TF_OTHER)
    for i in range(model.config.num_hidden_layers):
        names.update({f"bert/encoder/layer_{i}/{tf}": f"bert.encoder.layer.{i}.{hf}" for tf, hf in TF_LAYER.items()})
    assert len(names) == len(ours)
    variables = {tf: (ours[hf].T if tf.endswith("kernel") else ours[hf]).numpy() for tf, hf in names.items()}
    variables["bert/embeddings/word_embeddings"] = variables["bert/embeddings/word_embeddings"][:30522]
    variables["cls/predictions/output_bias"] = variables["cls/predictions/output_bias"][:30522]
    for slot in ("adam_m", "adam_v"):
        variables[f"bert/pooler/dense/kernel/{slot}"] = variables["bert/pooler/dense/kernel"]
    variables["global_step"] = 28252
    return variables


def test_tf_variables_convert_to_the_same_model():
    src = tiny(0)
    with torch.no_grad():  # the real checkpoint's vocabulary has 30522 rows: nothing beyond survives
        src.bert.embeddings.word_embeddings.weight[30522:] = 0
        src.cls.predictions.bias[30522:] = 1.0  # nonzero, so a wrong mapping of this tensor would show
    variables = fake_tf_variables(src)
    assert variables["bert/encoder/layer_1/intermediate/dense/kernel"].shape == (128, 512)
    dst = tiny(1)
    load_state(dst, convert_tf.convert(variables))
    with torch.no_grad():
        src.cls.predictions.bias[30522:] = 0
    assert_same_weights(src, dst)


def test_tf_names_map_like_nvidia_and_unknown_names_fail():
    assert convert_tf.torch_name("bert/encoder/layer_23/attention/output/LayerNorm/gamma") == \
        "bert.encoder.layer.23.attention.output.LayerNorm.weight"
    assert convert_tf.torch_name("cls/predictions/output_bias") == "cls.predictions.bias"
    assert convert_tf.torch_name("bert/encoder/layer_0/output/dense/kernel/LAMB") is None
    assert convert_tf.torch_name("bert/pooler/dense/bias/adam_v") is None
    # the rest of a TF LAMB run's optimizer state (NVIDIA's converter skips the same names)
    for slot in ("bert/encoder/layer_0/output/dense/kernel/LAMB_1", "cls/predictions/output_bias/LAMB_1",
                 "beta1_power", "beta2_power", "global_step", "good_steps", "loss_scale"):
        assert convert_tf.torch_name(slot) is None, slot
    with pytest.raises(ValueError, match="bert/pooler/dense/frobnicator"):
        convert_tf.torch_name("bert/pooler/dense/frobnicator")


def test_names_of_other_checkpoints_map_to_ours():
    """By hand: DDP's `module.` prefix, a bare `BertModel`'s names, and older HF files' LayerNorm gamma/beta
    (the scale is our weight, the shift our bias)."""
    assert to_our_name("module.cls.predictions.bias") == "cls.predictions.bias"
    assert to_our_name("encoder.layer.3.output.dense.weight") == "bert.encoder.layer.3.output.dense.weight"
    assert to_our_name("pooler.dense.bias") == "bert.pooler.dense.bias"
    assert to_our_name("bert.encoder.layer.0.attention.output.LayerNorm.gamma") == \
        "bert.encoder.layer.0.attention.output.LayerNorm.weight"
    assert to_our_name("embeddings.LayerNorm.beta") == "bert.embeddings.LayerNorm.bias"
    assert to_our_name("module.cls.predictions.transform.LayerNorm.gamma") == \
        "cls.predictions.transform.LayerNorm.weight"
    assert to_our_name(WORDS) == WORDS
