"""The LR schedule against its formula, written out here for each regime."""

from __future__ import annotations

import pytest
import torch

from bert.optim.schedule import WarmupPolyDecay


def run(steps: int, **kw) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    schedule = WarmupPolyDecay(opt, **kw)
    lrs = []
    for _ in range(steps):
        lrs.append(float(opt.param_groups[0]["lr"]))
        schedule.step()
    return lrs


def test_warmup_peak_decay_and_zero_at_the_end():
    lrs = run(12, base_lr=1.0, warmup_steps=4, start_warmup_step=0, decay_steps=10)
    assert lrs[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75])  # warmup from 0
    assert lrs[4] == pytest.approx(1 - 4 / 10)  # NVIDIA: decay is measured from step 0, not from the peak
    assert lrs[9] == pytest.approx(0.1)
    assert lrs[10:] == pytest.approx([0.0, 0.0])


def test_negative_start_warmup_step_shortens_the_warmup():
    lrs = run(4, base_lr=2.0, warmup_steps=100, start_warmup_step=-25, decay_steps=1000)
    assert lrs == pytest.approx([2.0 * 25 / 100, 2.0 * 26 / 100, 2.0 * 27 / 100, 2.0 * 28 / 100])


def test_samsung_decay_to_end_lr_then_hold():
    base, end = 3.9e-4, 4.9e-5
    lrs = run(300, base_lr=base, warmup_steps=82, start_warmup_step=-16, decay_steps=179, end_lr=end)
    assert lrs[65] == pytest.approx(base * (65 + 16) / 82, rel=1e-6)  # the last warmup step: 82 - 16 - 1
    assert lrs[66] == pytest.approx((base - end) * (1 - 66 / 179) + end, rel=1e-6)
    assert lrs[100] == pytest.approx((base - end) * (1 - 100 / 179) + end, rel=1e-6)
    assert lrs[179:] == pytest.approx([end] * 121, rel=1e-6)


def test_polynomial_power():
    lrs = run(6, base_lr=1.0, warmup_steps=0, start_warmup_step=0, decay_steps=5, power=2.0)
    assert lrs == pytest.approx([(1 - k / 5) ** 2 for k in range(6)], abs=1e-7)


def test_lr_is_one_device_tensor_shared_by_all_groups_and_resumable():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.0)
    schedule = WarmupPolyDecay(opt, base_lr=1.0, warmup_steps=0, start_warmup_step=0, decay_steps=10)
    for _ in range(3):
        schedule.step()
    assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"] is schedule.lr
    fresh_opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.0)
    fresh = WarmupPolyDecay(fresh_opt, base_lr=1.0, warmup_steps=0, start_warmup_step=0, decay_steps=10)
    fresh_opt.load_state_dict(opt.state_dict())  # brings back a saved copy of the LR tensor ...
    fresh.load_state_dict(schedule.state_dict())  # ... which the schedule replaces with its own again
    fresh.step()
    assert fresh_opt.param_groups[0]["lr"] is fresh_opt.param_groups[1]["lr"] is fresh.lr
    assert float(fresh_opt.param_groups[1]["lr"]) == pytest.approx(0.6)
