"""LAMB and AdamW against float64 reference updates written out tensor by tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bert.config import OptimConfig, from_flat
from bert.optim import build_optimizer, build_schedule, decay_groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(6, 5)
        self.LayerNorm = nn.LayerNorm(5)
        self.zero_weight = nn.Parameter(torch.zeros(3, 2))  # trust ratio falls back to 1 when ||p|| = 0


def config(optimizer: str, **kw) -> OptimConfig:
    base = dict(input_dir="x", eval_dir="x", bert_config_path="tiny", train_batch_size=1, learning_rate=2e-3,
                max_steps=10, warmup_steps=2, start_warmup_step=-1, optimizer=optimizer, weight_decay_rate=0.1,
                opt_lamb_beta_1=0.8, opt_lamb_beta_2=0.95, opt_epsilon=1e-6)
    return from_flat(**{**base, **kw}).optim


def lr_at(cfg: OptimConfig, k: int) -> float:
    w = k - cfg.start_warmup_step
    if w < cfg.warmup_steps:
        return cfg.learning_rate * w / cfg.warmup_steps
    return cfg.learning_rate * (1 - min(k / cfg.max_steps, 1.0))


def reference_step(cfg, p, m, v, g, t, lr, decay, trust_ratios: list | None = None) -> tuple:
    """One update of one tensor in float64; returns the new (p, m, v) (and appends LAMB's trust ratio)."""
    b1, b2, eps, wd = cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2, cfg.opt_epsilon, cfg.weight_decay_rate if decay else 0
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    if cfg.optimizer == "adam":  # AdamW: decoupled decay, then the Adam step
        return p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps), m, v
    u = m_hat / (v_hat.sqrt() + eps) + wd * p
    p_norm, u_norm = p.norm().item(), u.norm().item()
    trust = p_norm / u_norm if (decay and p_norm > 0 and u_norm > 0) else 1.0
    if trust_ratios is not None:
        trust_ratios.append(trust)
    return p - lr * trust * u, m, v


# Gradient scale per parameter; "edges" adds the regimes the typical one never reaches: gradients near eps
# (where eps inside or outside the bias-corrected sqrt(v) differ) and weights so large against their update
# that LAMB's trust ratio is far above 10 (some LAMB variants clip it there; apex's and the submissions' do not).
GRAD_SCALES = {"typical": {"bias": 0.1}, "edges": {"bias": 0.1, "LayerNorm.bias": 1e-7, "LayerNorm.weight": 3e-7}}


@pytest.mark.parametrize("regime", ["typical", "edges"])
@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_optimizer_matches_float64_reference(optimizer, regime):
    torch.manual_seed(0)
    cfg = config(optimizer, **({"weight_decay_rate": 0.01} if regime == "edges" else {}))
    model = Tiny()
    if regime == "edges":
        with torch.no_grad():
            model.dense.weight.mul_(100.0)
    opt = build_optimizer(model, cfg)
    schedule = build_schedule(opt, cfg)
    names = [n for n, _ in model.named_parameters()]
    ref = {n: (p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64),
               torch.zeros_like(p, dtype=torch.float64)) for n, p in model.named_parameters()}
    scales = GRAD_SCALES[regime]
    trust_ratios = []
    for t in range(1, 7):
        grads = {n: torch.randn_like(p) * scales.get(n, scales["bias"] if "bias" in n else 1.0)
                 for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        schedule.step()
        for n in names:
            decay = not ("bias" in n or "LayerNorm" in n)
            ref[n] = reference_step(cfg, *ref[n], grads[n].double(), t, lr_at(cfg, t - 1), decay, trust_ratios)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), ref[n][0], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    if optimizer == "lamb":  # the regime is what it claims to be
        assert (max(trust_ratios) > 20) == (regime == "edges"), max(trust_ratios)


def test_schedule_decays_to_the_end_lr_at_lr_max_steps_then_holds():
    """LR_MAX_STEPS < MAX_STEPS (Samsung's schedule): linear decay from 2e-3 reaches END_LR at update 4 and
    stays there, by hand; without LR_MAX_STEPS the decay runs to MAX_STEPS."""
    def lrs(**kw) -> list[float]:
        cfg = config("adam", warmup_steps=0, start_warmup_step=0, **kw)
        opt = build_optimizer(Tiny(), cfg)
        schedule = build_schedule(opt, cfg)
        out = []
        for _ in range(6):
            out.append(opt.param_groups[0]["lr"].item())
            schedule.step()
        return out

    end = 1e-4
    want = [2e-3, end + 1.9e-3 * 0.75, end + 1.9e-3 * 0.5, end + 1.9e-3 * 0.25, end, end]
    assert lrs(lr_max_steps=4, end_learning_rate=end) == pytest.approx(want, rel=1e-6)
    assert lrs() == pytest.approx([2e-3 * (1 - k / 10) for k in range(6)], rel=1e-6)


def test_lamb_trust_ratio_is_per_tensor():
    """Scaling one tensor's weights by 10 scales its LAMB step by 10 and leaves the other tensor's step alone."""
    cfg = config("lamb", warmup_steps=0, start_warmup_step=0, weight_decay_rate=0.0)

    def steps(scale: float) -> list[torch.Tensor]:
        torch.manual_seed(1)
        a, b = nn.Parameter(torch.randn(4) * scale), nn.Parameter(torch.randn(4))
        model = nn.Module()
        model.a, model.b = a, b
        opt = build_optimizer(model, config("lamb", weight_decay_rate=1e-12, warmup_steps=0, start_warmup_step=0))
        build_schedule(opt, cfg)
        before = [a.detach().clone(), b.detach().clone()]
        a.grad, b.grad = torch.ones(4), torch.ones(4)
        opt.step()
        return [before[0] - a.detach(), before[1] - b.detach()]

    (da1, db1), (da10, db10) = steps(1.0), steps(10.0)
    torch.testing.assert_close(da10, 10 * da1, rtol=1e-4, atol=0)
    torch.testing.assert_close(db10, db1)


def test_no_weight_decay_on_bias_and_layernorm():
    model = Tiny()
    decay, no_decay = decay_groups(model, 0.01)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    ids = lambda params: {id(p) for p in params}
    assert ids(decay["params"]) == ids([model.dense.weight, model.zero_weight])
    assert ids(no_decay["params"]) == ids([model.dense.bias, model.LayerNorm.weight, model.LayerNorm.bias])


def test_samsung_adam_epsilon_is_used():
    """eps = 1e-9 makes the first Adam step ~lr * sign(g) even for tiny gradients; eps = 1e-6 does not."""
    def first_step(eps: float) -> float:
        model = nn.Linear(1, 1, bias=False)
        opt = build_optimizer(model, config("adam", opt_epsilon=eps, weight_decay_rate=0.0, warmup_steps=0,
                                            start_warmup_step=0))
        build_schedule(opt, config("adam", warmup_steps=0, start_warmup_step=0))
        before = model.weight.item()
        model.weight.grad = torch.full((1, 1), 1e-8)
        opt.step()
        return before - model.weight.item()

    assert math.isclose(first_step(1e-9), 2e-3 / (1 + 0.1), rel_tol=1e-3)
    assert first_step(1e-6) < 2e-3 * 0.02
