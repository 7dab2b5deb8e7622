"""The FLOP formula of bert.model.flops against torch's FlopCounterMode on the real model (CPU, float64)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bert.model import BertConfig, BertForPreTraining
from bert.model.flops import StepShape, batch_train_flops, forward_flops, train_flops
from bert.model.last_layer import kept_row_count
from bert.model.pretraining import shapes_only
from bert.synthetic import random_batch

# Small and odd-sized (h != i, vocab padded 2042 -> 2048), so a transposed or missing term shows.
CFG = BertConfig(vocab_size=2048, real_vocab_size=2042, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                 intermediate_size=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
BATCHES = {"one_token": (1,), "full_512": (512,), "mixed": (3, 1, 77, 260, 130, 385)}


def counted(run) -> tuple[int, int]:
    """FLOPs FlopCounterMode sees in the forward and in forward + backward. SDPA is forced onto its math
    path, whose matmuls (bmm) the counter sees; the fused CPU kernel it would otherwise pick is not counted."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            run()
        with FlopCounterMode(display=False) as step:
            run().loss.backward()
    return fwd.get_total_flops(), step.get_total_flops()


@pytest.mark.parametrize("subset", (True, False), ids=("last_layer_subset", "full_last_layer"))
@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES.keys())
def test_unpadded_step_flops_equal_the_counted_ones(lengths, subset):
    torch.manual_seed(0)
    model = BertForPreTraining(CFG, attention="loop", last_layer_subset=subset).double()
    batch = random_batch(lengths, seed=len(lengths), vocab_size=CFG.real_vocab_size)
    fwd, step = counted(lambda: model(batch))
    shape = StepShape.of_batch(batch, subset)
    B, M = len(lengths), len(batch.masked_labels)
    kept = -(-(B + M) // 16) * 16 if subset else None  # [CLS] and masked rows, to a multiple of 16
    assert shape == StepShape(sum(lengths), sum(n * n for n in lengths), B, M, kept)
    assert forward_flops(CFG, shape) == fwd
    assert train_flops(CFG, shape) == batch_train_flops(CFG, batch, subset) == step


@pytest.mark.parametrize("path", ("padded_backend", "padded_model"))
def test_padded_shapes_equal_the_counted_ones(path):
    """The padded attention backend scores B*L^2 pairs; the padded model also runs B*L rows through the linears."""
    torch.manual_seed(0)
    lengths = BATCHES["mixed"]
    batch = random_batch(lengths, seed=1, vocab_size=CFG.real_vocab_size)
    B, L, T, M = len(lengths), max(lengths), sum(lengths), len(batch.masked_labels)
    if path == "padded_backend":
        shape = StepShape(T, B * L * L, B, M, kept_row_count(B, M))  # the last layer keeps R rows after attention
        model = BertForPreTraining(CFG, attention="padded").double()
        run = lambda: model(batch)
    else:
        model, shape = BertForPreTraining(CFG, attention="loop").double(), StepShape(B * L, B * L * L, B, M)
        run = lambda: model.forward_padded(batch)
    fwd, step = counted(run)
    assert (forward_flops(CFG, shape), train_flops(CFG, shape)) == (fwd, step)


def test_bert_large_is_6_flops_per_weight_and_token_plus_attention():
    """BERT-large, one sequence of 512 tokens with 76 masked: 6 FLOPs per (weight-matrix entry, row it
    is applied to), from the parameters of the real module, plus 3 x 4 x len^2 x h per layer for attention."""
    cfg = BertConfig.load("large")
    model = shapes_only(cfg)
    n, m = 512, 76
    encoder = sum(p.numel() for name, p in model.bert.encoder.named_parameters() if name.endswith("dense.weight")
                  or name.endswith("qkv.weight"))
    pooler_nsp = model.bert.pooler.dense.weight.numel() + model.cls.seq_relationship.weight.numel()
    mlm = model.cls.predictions.transform.dense.weight.numel() + model.bert.embeddings.word_embeddings.weight.numel()
    want = 6 * (encoder * n + pooler_nsp + mlm * m) + 3 * cfg.num_hidden_layers * 4 * n * n * cfg.hidden_size
    assert train_flops(cfg, StepShape.unpadded([n], m, last_layer_subset=False)) == want
    assert round(want / 1e12, 2) == 1.02
