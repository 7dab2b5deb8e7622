"""The training step on a device that is not the CPU, without a GPU.

On the CPU every tensor is a CPU tensor, so the rest of the suite cannot see one made without `device=` that a GPU
run then mixes with its CUDA tensors ("Expected all tensors to be on the same device", found on the GPU only, as
the attention test's reference mask once was), or copies back to the host every step. torch's meta device carries
shapes, dtypes and devices but no data: the model's forward and backward and the optimizer's update run their
shape, dtype and device checks there. An operand left on the CPU fails as it would on a GPU (elementwise ops,
matmuls, indexing, foreach), and a copy from the device into a host tensor fails ("no data"), where on a GPU it
would be a host sync per step. Not every op checks on meta (`scatter_` takes a CPU source there), and a 0-dim CPU
tensor passes as a scalar, as on CUDA. The mutants `master-flat-grad-on-host`, `kept-rows-on-host` and
`schedule-lr-on-host` (scripts/mutants.json) each pass their module's CPU tests and fail here.

Left out, as meta cannot run them: whatever reads data (`.item()`, the evaluation's counts), DDP (its constructor
checks the ranks' parameters by value), torch's fused AdamW with a tensor LR (no meta kernel) and the CUDA-only
attention kernels. torch refuses foreach kernels on meta; the fixture lets it (they have meta versions).
"""

import importlib.util

import pytest
import torch
import torch.utils._foreach_utils as foreach_utils

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model.fp8 import FP8_RECIPES, convert_to_fp8
from bert.optim import build_optimizer, build_schedule
from bert.static_shapes import pad_static
from bert.synthetic import random_batch
from bert.train.warmup import model_sizes, warmup_batch

META = torch.device("meta")
LENGTHS = (5, 17, 64, 30, 2)


@pytest.fixture(autouse=True)
def foreach_on_meta(monkeypatch):
    foreach = foreach_utils._get_foreach_kernels_supported_devices
    monkeypatch.setattr(foreach_utils, "_get_foreach_kernels_supported_devices", lambda: [*foreach(), "meta"])


def meta_model(attention: str = "loop", last_layer_subset: bool = True) -> BertForPreTraining:
    # initialised on the CPU (the truncated normal draws need data), then moved as the driver moves it
    return BertForPreTraining(BertConfig.load("tiny"), attention=attention, device=META,
                              last_layer_subset=last_layer_subset).to(META)


def check_grads(model: BertForPreTraining) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert (p.grad.device, p.grad.dtype, p.grad.shape) == (META, p.dtype, p.shape), name


@pytest.mark.parametrize("last_layer_subset", [True, False])
@pytest.mark.parametrize("attention", ["loop", "grouped", "padded"])
@pytest.mark.parametrize("static_tokens", [0, 128])
def test_forward_and_backward_stay_on_the_device(attention, last_layer_subset, static_tokens):
    """Each attention backend the CPU runs, with and without the last layer's subset, on a batch as the loader
    hands it over (STATIC_TOKENS padded on the host, then moved)."""
    model = meta_model(attention, last_layer_subset)
    batch = pad_static(random_batch(LENGTHS, vocab_size=model.config.real_vocab_size), static_tokens).to(META)
    out = model(batch)
    assert {t.device for t in (out.loss, out.mlm_logits, out.nsp_logits, out.mlm_correct, out.mlm_total)} == {META}
    out.loss.backward()
    check_grads(model)


def test_the_padded_model_stays_on_the_device():
    model = meta_model()
    out = model.forward_padded(random_batch(LENGTHS, vocab_size=model.config.real_vocab_size).to(META))
    out.loss.backward()
    check_grads(model)


def test_the_warm_up_batch_is_made_on_the_device():
    model = meta_model()
    batch = warmup_batch(6, 64, META, model.config.real_vocab_size, avoid=model_sizes(model.config), static_tokens=128)
    model(batch).loss.backward()
    check_grads(model)


def lamb_steps(model: BertForPreTraining, precision: str, master_weights: bool, static_tokens: int = 0) -> None:
    """Two steps with the driver's LAMB (decay groups, the schedule's device LR, the `after` clip; with master
    weights the fp32 masters, and under fp16 the scale and overflow flag GradScaler hands the step, so the update
    skips an overflow on the device); then masters, state and weights are on the device in their dtypes."""
    cfg = from_flat(optimizer="lamb", learning_rate=1e-3, warmup_steps=1, max_steps=10, grad_clip="after",
                    master_weights=master_weights, precision=precision, max_grad_norm=1.0,
                    static_tokens=static_tokens).optim
    compute = {"fp8": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    opt = build_optimizer(model, cfg, compute)
    schedule = build_schedule(opt, cfg)
    if precision == "fp16":
        opt.grad_scale = torch.full((), 2.0**16, device=META)
        opt.found_inf = torch.zeros((), device=META)
    batch = pad_static(random_batch(LENGTHS, vocab_size=model.config.real_vocab_size), static_tokens).to(META)
    for _ in range(2):
        model(batch).loss.backward()
        if not master_weights:  # MasterWeights clips inside its step; otherwise the loop's Clipper does
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    assert {(p.device, p.dtype) for p in model.parameters()} == {(META, compute)}
    # the LR every group reads, and the loop's loss accumulators (made on its device), are on the device too
    assert schedule.lr.device == META and {g["lr"].device for g in opt.param_groups} == {META}
    inner = opt.inner if master_weights else opt
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and {t.device for t in state} == {META}
    if master_weights:
        assert {(m.device, m.dtype) for m in opt.masters} == {(META, torch.float32)}


@pytest.mark.parametrize("master_weights, precision", [(True, "bf16"), (True, "fp16"), (False, "fp32")])
def test_the_lamb_step_stays_on_the_device(master_weights, precision):
    lamb_steps(meta_model(), precision, master_weights)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (not in the CPU "
                    "install; scripts/test_torch.sh adds it)")
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_float8_step_on_master_weights_stays_on_the_device(recipe):
    """PRECISION=fp8 with MASTER_WEIGHTS=1, the next GPU session's `driver-fp8`, not yet run on a GPU: torchao's
    float8 linears (their float8 casts and `torch._scaled_mm`, not the emulation) on bf16 weights, LAMB on the fp32
    masters, the batch padded to STATIC_TOKENS as float8 needs."""
    model = BertForPreTraining(BertConfig.load("tiny"), attention="loop", device=META)
    assert convert_to_fp8(model, recipe=recipe)
    lamb_steps(model.to(META), "fp8", master_weights=True, static_tokens=128)


def test_shapes_only_builds_every_parameter_on_meta_and_draws_no_weights():
    """The benches' BERT-large for counting and planning: the CPU model's names and shapes, no storage, and no
    random draw (drawing BERT-large's weights took most of a CPU-minute of the shard benches)."""
    from bert.model.pretraining import shapes_only

    cfg = BertConfig.load("tiny")
    rng = torch.get_rng_state()
    model = shapes_only(cfg)
    assert torch.equal(torch.get_rng_state(), rng)
    assert {p.device for p in model.parameters()} == {META}
    cpu = BertForPreTraining(cfg, attention="padded")
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in cpu.named_parameters()]
