"""apex's FusedLAMB behind torch's optimizer interface (bert.optim.apex_lamb), against a stand-in with apex's
interface: `zero_grad(self)` without `set_to_none`, and a kernel that takes the LR as a float (apex converts a
tensor with `.item()`, a host sync per step, so the stand-in refuses one). Its arithmetic is our LAMB's, so the
weights after the schedule's steps must equal our LAMB's under the schedule's device tensor, bit for bit."""

from __future__ import annotations

import copy
import functools
import sys
import types

import pytest
import torch

from bert.optim import OPTIMIZERS, Lamb, WarmupPolyDecay
from bert.optim.apex_lamb import apex_lamb
from bert.optim.master import MasterWeights

BETAS, EPS = (0.6, 0.85), 1e-6


class StandInFusedLAMB(Lamb):
    """apex.optimizers.FusedLAMB's constructor, zero_grad, LR type and update count (in the group, none in the
    parameters' state); our LAMB's update."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        assert bias_correction and adam_w_mode and not use_nvlamb and max_grad_norm == float("inf")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.defaults.update(bias_correction=bias_correction, grad_averaging=grad_averaging)
        for group in self.param_groups:
            group.update(bias_correction=bias_correction, grad_averaging=grad_averaging)
        self.set_grad_none = set_grad_none

    def zero_grad(self):  # apex's signature
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self, closure=None):
        for group in self.param_groups:
            assert group["bias_correction"] and group["grad_averaging"]  # apex's step reads both from the group
            if type(group["lr"]) is not float:
                raise AssertionError(f"apex would read a {type(group['lr']).__name__} LR with .item(): a host sync")
            group["step"] = group.get("step", 0) + 1  # apex's bookkeeping
            for p in group["params"]:
                if self.state[p]:
                    self.state[p]["step"] = group["step"] - 1  # our update reads it, adds 1 ...
        super().step(closure)
        for state in self.state.values():
            del state["step"]  # ... and apex keeps none there


@pytest.fixture
def apex(monkeypatch):
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedLAMB = StandInFusedLAMB
    package = types.ModuleType("apex")
    package.optimizers = optimizers
    monkeypatch.setitem(sys.modules, "apex", package)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)


def groups(seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    decay = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    no_decay = [torch.nn.Parameter(torch.randn(5))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 6, start: int = 0) -> None:
    schedule = WarmupPolyDecay(optimizer, base_lr=0.01, warmup_steps=3, start_warmup_step=0, decay_steps=5)
    schedule.load_state_dict({"updates": torch.tensor(float(start))})
    for i in range(start, start + steps):
        for p in params:
            p.grad = torch.sin(p.detach().float() * (i + 1)).to(p.dtype)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)  # as the loop calls it
        assert all(p.grad is None for p in params)


def test_without_apex_there_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)
    assert apex_lamb(groups(), BETAS, EPS) is None
    assert type(OPTIMIZERS["lamb"](groups(), lr=torch.tensor(0.0), betas=BETAS, eps=EPS, on_cuda=True)) is Lamb


def test_apex_takes_the_schedules_lr_as_a_float_and_torchs_zero_grad(apex):
    ours, theirs = groups(), groups()
    fused = OPTIMIZERS["lamb"](theirs, lr=torch.tensor(0.0), betas=BETAS, eps=EPS, on_cuda=True)
    assert isinstance(fused, StandInFusedLAMB) and fused.host_lr
    plain = Lamb(ours, lr=torch.tensor(0.0), betas=BETAS, eps=EPS)
    train(fused, [p for g in theirs for p in g["params"]])
    train(plain, [p for g in ours for p in g["params"]])
    for a, b in zip((p for g in ours for p in g["params"]), (p for g in theirs for p in g["params"])):
        assert torch.equal(a, b)
    assert isinstance(plain.param_groups[0]["lr"], torch.Tensor)  # every other optimizer keeps the device tensor


def test_master_weights_hand_apex_the_float(apex):
    """MASTER_WEIGHTS=1 (the DGX configs) with apex installed: the schedule writes floats into the outer groups,
    which the master step copies into apex's."""
    ours, theirs = groups(), groups()
    build = functools.partial(OPTIMIZERS["lamb"], lr=torch.tensor(0.0), betas=BETAS, eps=EPS)
    fused = MasterWeights(theirs, functools.partial(build, on_cuda=True), torch.bfloat16)
    plain = MasterWeights(ours, functools.partial(build, on_cuda=False), torch.bfloat16)
    assert fused.host_lr and not plain.host_lr and isinstance(fused.inner, StandInFusedLAMB)
    train(fused, [p for g in theirs for p in g["params"]])
    train(plain, [p for g in ours for p in g["params"]])
    for a, b in zip(plain.masters, fused.masters):
        assert torch.equal(a, b)


def flat(groups: list[dict]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


@pytest.mark.parametrize("master", [False, True], ids=["plain", "master-weights"])
@pytest.mark.parametrize("first,then", [("apex", "apex"), ("apex", "ours"), ("ours", "apex")])
def test_a_checkpoint_moves_between_apex_and_our_lamb(apex, master, first, then):
    """Three steps, a checkpoint, a fresh optimizer (apex's or ours: a resume where apex is missing, or under
    COMPILE_OPTIMIZER=1, which always runs ours), three more: the same weights as six steps of ours, bit for bit.
    apex counts its updates in the group, which MasterWeights' saved groups left out (bias correction restarted
    at 1) and our LAMB could not read."""
    def build(params: list[dict], which: str) -> torch.optim.Optimizer:
        make = functools.partial(OPTIMIZERS["lamb"], lr=torch.tensor(0.0), betas=BETAS, eps=EPS,
                                 on_cuda=which == "apex")
        return MasterWeights(params, make, torch.bfloat16) if master else make(params)

    def weights(opt: torch.optim.Optimizer, params: list[dict]) -> list[torch.Tensor]:
        return opt.masters if master else flat(params)

    reference_groups, resumed_groups = groups(), groups()
    reference = build(reference_groups, "ours")
    train(reference, flat(reference_groups), steps=6)
    before = build(resumed_groups, first)
    train(before, flat(resumed_groups), steps=3)
    saved = copy.deepcopy(before.state_dict())
    after = build(resumed_groups, then) if not master else None
    if master:  # the model's parameters are bf16 now: a new MasterWeights takes fp32 ones, as a fresh process has
        for p, m in zip(flat(resumed_groups), before.masters):
            p.data = m.clone()
        after = build(resumed_groups, then)
    after.load_state_dict(saved)
    train(after, flat(resumed_groups), steps=3, start=3)
    for a, b in zip(weights(reference, reference_groups), weights(after, resumed_groups)):
        assert torch.equal(a, b)
