"""COMPILE_OPTIMIZER (bert.optim.compiled): the compiled optimizer step equals the eager one within fp32
rounding, for LAMB and ADAM as `build_optimizer` makes them, over steps with a changing device-tensor LR; the
warm-up compiles before run_start and leaves training unchanged; LAMB's device step counter against the host one.
With MASTER_WEIGHTS=1 (bert.optim.master) the compiled update over the fp32 masters against the eager
MasterWeights (itself tested against the plain fp32 optimizer in test_master_weights.py), bf16 and fp16 (the
GradScaler's unscale and an overflow skip), and the warm-up restoring the masters, the inner state and the model.

The CPU tests compile with torch's `aot_eager` backend (COMPILE=debug: dynamo and AOT autograd capture the
step, then it runs eagerly), which checks the capture; inductor's code generation and CUDA graphs
(COMPILE=reduce-overhead, which compiles the optimizer without CUDA graphs) are checked by the CUDA tests at
the end.
"""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from bert.config import ConfigError, from_flat
from bert.optim import Lamb, build_optimizer, build_schedule
from bert.optim.compiled import compile_step, warm_up_step
from bert.optim.master import MasterWeights


def make(optimizer: str, compiled: bool, device: str = "cpu", dtype: torch.dtype | None = None):
    """A small model (a decayed matrix, undecayed bias and LayerNorm), its optimizer and LR schedule; with
    `dtype` (bf16/fp16) under MASTER_WEIGHTS=1, clipping `after` in the step (so the clip is compiled too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)).to(device)
    master = dict(master_weights=True, precision={torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
                  grad_clip="after", max_grad_norm=3.0) if dtype else {}
    cfg = from_flat(optimizer=optimizer, learning_rate=0.05, warmup_steps=2, max_steps=10,
                    weight_decay_rate=0.01, compile_optimizer=True, **master).optim
    opt = build_optimizer(model, cfg, dtype or torch.float32)  # capturable either way: the compiled step differs
    schedule = build_schedule(opt, cfg)
    if compiled:
        compile_step(opt, "debug" if device == "cpu" else "reduce-overhead")
    return model, opt, schedule


def train(model, opt, schedule, steps: int, seed: int = 1, scaler=None, overflow_at: int = -1
          ) -> list[torch.Tensor]:
    """`steps` steps on random gradients (scaled by the GradScaler's scale when given, with an inf at step
    `overflow_at`); the weights after (MASTER_WEIGHTS=1: the masters, then the model's in the same order)."""
    gen = torch.Generator().manual_seed(seed)
    for k in range(steps):
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=gen) * (scaler.get_scale() if scaler else 1.0)
            p.grad = grad.to(p.device, p.dtype)
        if k == overflow_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        schedule.step()  # a new LR each step: data in the LR tensor, not a recompile
        opt.zero_grad(set_to_none=True)
    master = isinstance(opt, MasterWeights)  # its masters, then the model's weights in the same (group) order
    return [w.detach().clone() for w in ([*opt.masters, *opt.params] if master else model.parameters())]


def assert_close_masters(eager: list[torch.Tensor], compiled: list[torch.Tensor], dtype: torch.dtype) -> None:
    """The masters within fp32 rounding (2e-6 on weights of order 1, as the plain step below) and the model's
    weights exactly the compiled masters rounded to `dtype` (the copy back is a plain cast)."""
    n = len(eager) // 2
    moved = [(a - b).abs().max() for a, b in zip(eager[:n], compiled[:n])]
    assert all(d < 2e-6 for d in moved), moved
    assert all(p.dtype == dtype and torch.equal(p, m.to(dtype)) for m, p in zip(compiled[:n], compiled[n:]))


@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_compiled_step_equals_eager_step(optimizer):
    """Within fp32 rounding (2e-6 on weights of order 1). LAMB is bit for bit under torch 2.13 but not under
    2.11 (seen on the H100 machine). ADAM: torch's own AdamW computes its bias corrections from the step tensor
    when compiled and from the step's host value (`.item()`, float64) when eager
    (`torch.optim.optimizer._get_value`), so on the CPU the two differ by fp32 rounding (7e-7 here)."""
    torch._dynamo.reset()
    eager = train(*make(optimizer, compiled=False), steps=4)
    counters.clear()
    compiled = train(*make(optimizer, compiled=True), steps=4)
    assert counters["stats"]["unique_graphs"] >= 1  # the step was captured, not skipped
    moved = [(a - b).abs().max() for a, b in zip(eager, compiled)]
    assert all(d < 2e-6 for d in moved), moved
    assert all(torch.equal(a, b) for a, b in zip(eager, train(*make(optimizer, compiled=False), steps=4)))


def test_warm_up_compiles_before_the_run_and_leaves_training_unchanged():
    reference = train(*make("lamb", compiled=False), steps=3)  # compiled LAMB ~ eager (the test above)
    torch._dynamo.reset()
    model, opt, schedule = make("lamb", compiled=True)
    warm_up_step(opt)
    assert all(p.grad is None for p in model.parameters())
    counters.clear()
    after = train(model, opt, schedule, steps=3)
    assert all((a - b).abs().max() < 2e-6 for a, b in zip(reference, after))  # as compiled vs eager above
    assert counters["stats"].get("unique_graphs", 0) == 0  # the timed steps compiled nothing


@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_compiled_master_update_equals_the_eager_one(optimizer):
    """MASTER_WEIGHTS=1, bf16: the compiled cast-up, clip, update and copy-back against the eager MasterWeights."""
    eager = train(*make(optimizer, compiled=False, dtype=torch.bfloat16), steps=4)
    torch._dynamo.reset()
    counters.clear()
    model, opt, schedule = make(optimizer, compiled=True, dtype=torch.bfloat16)
    assert "update_masters" in vars(opt) and "step" not in vars(opt)  # GradScaler still calls the eager step
    compiled = train(model, opt, schedule, steps=4)
    assert counters["stats"]["unique_graphs"] >= 1
    assert_close_masters(eager, compiled, torch.bfloat16)
    assert not torch.equal(eager[0], make(optimizer, compiled=False, dtype=torch.bfloat16)[1].masters[0])  # trained
    assert all(m.grad is None for m in opt.masters)


def test_master_warm_up_restores_everything_and_fp16_steps_compile_nothing_after_it():
    """fp16: the warm-up compiles the update with the GradScaler's unscale and overflow flag; afterwards the
    masters, the inner state (zeros, update count 0) and the model are as before, and the scaled steps, one of
    them an overflow skipped on the device, equal the eager MasterWeights' without compiling anything."""
    def run(compiled: bool) -> list[torch.Tensor]:
        model, opt, schedule = make("lamb", compiled=compiled, dtype=torch.float16)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
        scaler.scale(torch.ones(()))  # as the loop does first: creates the scale tensor
        if compiled:
            before = [w.detach().clone() for w in [*opt.masters, *model.parameters()]]
            warm_up_step(opt)
            after = [w.detach().clone() for w in [*opt.masters, *model.parameters()]]
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            assert all(p.grad is None for p in model.parameters()) and not hasattr(opt, "grad_scale")
            state = [opt.inner.state[m] for m in opt.masters]
            assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() and s["step"].item() == 0 for s in state)
            counters.clear()
        weights = train(model, opt, schedule, steps=4, scaler=scaler, overflow_at=1)
        assert scaler.get_scale() == 2.0**5  # one overflow: halved once
        return weights

    eager = run(compiled=False)
    torch._dynamo.reset()
    compiled = run(compiled=True)
    assert counters["stats"].get("unique_graphs", 0) == 0  # the timed steps compiled nothing
    assert_close_masters(eager, compiled, torch.float16)


def test_the_optimizer_is_compiled_without_cuda_graphs(monkeypatch):
    """reduce-overhead and max-autotune compile the step without CUDA graphs (compiled LAMB segfaulted inside
    them on the H100); under MASTER_WEIGHTS=1 the update is compiled, not the step GradScaler calls."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, backend, mode: seen.append((fn.__name__, backend, mode)) or fn)
    for name, mode in [("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs"),
                       ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"), ("default", "default")]:
        seen.clear()
        compile_step(make("lamb", compiled=False)[1], name)
        compile_step(make("lamb", compiled=False, dtype=torch.bfloat16)[1], name)
        assert seen == [("step", "inductor", mode), ("_update_masters", "inductor", mode)], name


def test_lamb_device_step_counter_matches_the_host_one():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8))]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    host = Lamb([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:]}], lr=0.05)
    device = Lamb([{"params": copies[:1], "weight_decay": 0.01}, {"params": copies[1:]}], lr=0.05, capturable=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        for a, b in zip(params, copies):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        host.step()
        device.step()
    assert torch.is_tensor(device.state[copies[0]]["step"]) and device.state[copies[0]]["step"].item() == 5
    for a, b in zip(params, copies):  # float64 bias corrections both, the same pow and sqrt: the same bits
        assert torch.equal(a, b)


def test_compile_optimizer_needs_a_compile_mode_and_no_sharding():
    base = dict(input_dir="d", eval_dir="e", train_batch_size=8, bert_config_path="tiny", learning_rate=1e-3,
                max_steps=10, compile_optimizer=True)
    with pytest.raises(ConfigError, match=r"\$COMPILE_OPTIMIZER.*needs a COMPILE mode"):
        from_flat(**base).validate()
    with pytest.raises(ConfigError, match=r"\$COMPILE_OPTIMIZER.*OPTIMIZER_SHARDING"):
        from_flat(**base, compile="debug", optimizer_sharding=True).validate()
    from_flat(**base, compile="debug").validate()
    from_flat(**base, compile="debug", master_weights=True, precision="bf16").validate()  # fused on the masters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_cuda_compiled_step_is_close_to_eager(optimizer):
    """COMPILE=reduce-overhead: inductor's kernels (no CUDA graph for the optimizer), against the eager step."""
    torch._dynamo.reset()
    eager = train(*make(optimizer, compiled=False, device="cuda"), steps=6)
    compiled = train(*make(optimizer, compiled=True, device="cuda"), steps=6)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_master_lamb_is_close_to_eager():
    """MASTER_WEIGHTS=1, bf16, LAMB: inductor's fused update over the masters against the eager foreach one
    (capturable LAMB both: fp32 bias corrections on the device), after the warm-up the driver runs."""
    torch._dynamo.reset()
    eager = train(*make("lamb", compiled=False, device="cuda", dtype=torch.bfloat16), steps=6)
    model, opt, schedule = make("lamb", compiled=True, device="cuda", dtype=torch.bfloat16)
    warm_up_step(opt)
    compiled = train(model, opt, schedule, steps=6)
    n = len(eager) // 2
    for a, b in zip(eager[:n], compiled[:n]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for m, p in zip(compiled[:n], compiled[n:]))
