"""OPTIMIZER_LAYOUT=flat (bert.optim.flat): LAMB over flat buffers of whole rows, inside MasterWeights.

The reference is the per-tensor layout: MasterWeights over the foreach `Lamb` (itself checked against float64 in
test_optim.py and against the plain fp32 optimizer in test_master_weights.py), fed the same gradients. The flat
masters must stay within fp32 rounding of it (only the trust ratio's norms sum in another order), the model's
weights must be the flat masters rounded, and the padding must stay zero. Rows of 8 elements here, so that
tensors span several rows and share none; the config's build (rows of 2,048) is checked on the driver's model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_master_weights import STEPS, batches
from test_master_weights import build as build_run
from test_master_weights import config as config_mw
from test_optim_compiled import train
from torch import nn

from bert.config import from_flat
from bert.optim import Lamb, build_optimizer, build_schedule
from bert.optim.compiled import compile_step, warm_up_step
from bert.optim.flat import FlatLamb, FlatLayout, _Part, tensor_sums
from bert.optim.master import MasterWeights
from bert.optim.param_groups import decay_groups
from bert.train.checkpoint import load_checkpoint, save_checkpoint
from bert.train.loop import train_step

pytestmark = pytest.mark.usefixtures("one_thread")
ROW, C = 8, 0.5


def small_model(seed: int = 0) -> nn.Module:
    """Tensors of 1 to 6 rows of 8 (decayed: the weights, the LayerNorm's here; the biases not), most of them
    ending inside a row."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3), nn.Linear(3, 16))


def config(layout: str, precision: str = "bf16", clip: str = "after"):
    return from_flat(learning_rate=0.05, max_steps=10, warmup_steps=2, weight_decay_rate=0.1, grad_clip=clip,
                     max_grad_norm=C, master_weights=True, precision=precision, optimizer_layout=layout,
                     opt_lamb_beta_1=0.8, opt_lamb_beta_2=0.9)


def build(layout: str, precision: str = "bf16", clip: str = "after", row: int = ROW):
    """What build_optimizer makes for `layout`, the flat one with rows of `row` elements."""
    cfg = config(layout, precision, clip).optim
    model = small_model()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if layout == "tensors":
        opt = build_optimizer(model, cfg, dtype)
    else:
        inner = functools.partial(FlatLamb, lr=torch.tensor(cfg.learning_rate), betas=(0.8, 0.9),
                                  eps=cfg.opt_epsilon, chunk=row)
        opt = MasterWeights(decay_groups(model, cfg.weight_decay_rate), inner, dtype, C if clip == "after" else None)
    return model, opt, build_schedule(opt, cfg)


def assert_same_update(flat, tensors, tol: float = 2e-6) -> None:
    """Masters within fp32 rounding of the per-tensor layout's; the model's weights the flat masters rounded;
    the moments within rounding too, under the same per-tensor state layout."""
    for a, b in zip(flat.masters, tensors.masters, strict=True):
        assert (a - b).abs().max() <= tol
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(flat.params, flat.masters))
    ours, theirs = flat.state_dict()["state"], tensors.state_dict()["state"]
    assert ours.keys() == theirs.keys() and ours
    for i in ours:
        assert float(ours[i]["step"]) == float(theirs[i]["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert ours[i][k].shape == theirs[i][k].shape and (ours[i][k] - theirs[i][k]).abs().max() <= tol


def padding(opt: MasterWeights) -> list[torch.Tensor]:
    """The elements of every flat buffer outside the tensors' views."""
    inner, layout = opt.inner, opt.layout
    inside = torch.zeros(layout.rows * layout.chunk, dtype=torch.bool)
    for start, n in zip(layout.starts, layout.numels):
        inside[start * layout.chunk:start * layout.chunk + n] = True
    return [flat[~inside] for flat in (inner.weights, inner.exp_avg, inner.exp_avg_sq, inner.grad, opt.low)]


def test_layout_puts_each_tensor_on_its_own_rows():
    layout = FlatLayout((3, 8, 9, 1), chunk=4)
    assert (layout.counts, layout.starts, layout.rows) == ([1, 2, 3, 1], [0, 1, 3, 6], 7)
    flat = torch.arange(28.0)
    views = layout.views(flat, [torch.Size([3]), torch.Size([2, 4]), torch.Size([9]), torch.Size([1, 1])])
    assert [v.tolist() for v in views] == [[0.0, 1.0, 2.0], [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]],
                                           [float(i) for i in range(12, 21)], [[24.0]]]
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)


def test_tensor_sums_keep_a_small_tensor_after_a_large_one():
    """Each tensor's sum of its rows' sums against float64: a tensor whose sum is 3e-11 of the running total before
    it (an fp32 running sum, whose spacing there is 8, loses it whole; float64's, 1.5e-8, keeps it to 2e-6) and
    one-row tensors between many-row ones."""
    rows = torch.tensor([1e6] * 100 + [1e-3, 2e-3] + [0.5] + [3.0] * 7, dtype=torch.float32)
    ends = torch.tensor([100, 102, 103, 110])
    part = _Part(0, 110, torch.tensor([0, 100, 102, 103]), ends, torch.repeat_interleave(torch.arange(4), ends.diff(
        prepend=torch.tensor([0]))))
    expected = torch.stack([t.double().sum() for t in rows.split([100, 2, 1, 7])])
    assert torch.allclose(tensor_sums(rows, part).double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("clip", ["after", "none"])
def test_flat_steps_equal_the_per_tensor_lamb(clip):
    (model, opt, schedule), (ref_model, ref, ref_schedule) = build("flat", clip=clip), build("tensors", clip=clip)
    assert isinstance(opt.inner, FlatLamb) and opt.layout.counts == [5, 1, 2, 6, 1, 1, 1, 2]
    before = [m.clone() for m in opt.masters]
    for k in range(4):
        train(model, opt, schedule, 1, seed=k)
        train(ref_model, ref, ref_schedule, 1, seed=k)
        assert_same_update(opt, ref)
    assert all((m - b).abs().max() > 1e-3 for m, b in zip(opt.masters, before))  # every tensor trained
    assert all(p.abs().max() == 0 for p in padding(opt))
    # the model's parameters are views of the one low-precision buffer: the copy back reached them
    assert all(p.untyped_storage().data_ptr() == opt.low.untyped_storage().data_ptr() for p in model.parameters())


def _model_of(opt: MasterWeights) -> nn.Module:
    """A module over the optimizer's parameters (in its group order), so `train` can hand them gradients."""
    holder = nn.Module()
    for i, p in enumerate(opt.params):
        holder.register_parameter(f"p{i}", p)
    return holder


def test_fp16_overflow_changes_nothing_and_the_next_steps_match():
    """An inf at the second step: skipped on the device (no host read), then the same steps as the per-tensor
    layout under its own GradScaler."""
    runs = [build(layout, "fp16") for layout in ("flat", "tensors")]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in runs]
    for s in scalers:
        s.scale(torch.ones(()))
    for k in range(4):
        kept = [m.clone() for m in runs[0][1].masters]
        for (_, opt, schedule), scaler in zip(runs, scalers):
            train(_model_of(opt), opt, schedule, 1, seed=k, scaler=scaler, overflow_at=0 if k == 1 else -1)
        if k == 1:
            assert all(torch.equal(a, b) for a, b in zip(runs[0][1].masters, kept))
        assert_same_update(runs[0][1], runs[1][1])
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9


def load_weights(opt: MasterWeights, weights: list[torch.Tensor]) -> None:
    """As a checkpoint's load does: the fp32 weights written into the masters, the model's refreshed from them."""
    with torch.no_grad(), opt.masters_in_model():
        for p, w in zip(opt.params, weights):
            p.copy_(w)


def test_a_checkpoint_moves_between_the_layouts():
    """Flat state into the per-tensor layout and back; the steps after the load match an uninterrupted run."""
    flat_model, flat, flat_schedule = build("flat")
    train(flat_model, flat, flat_schedule, 3)
    saved = copy.deepcopy(flat.state_dict())  # as torch.save and torch.load would: torch's load keeps the tensors
    _, tensors, tensors_schedule = build("tensors")
    load_weights(tensors, flat.masters)
    tensors.load_state_dict(saved)
    tensors_schedule.load_state_dict(flat_schedule.state_dict())
    _, back, back_schedule = build("flat")
    back.load_state_dict(copy.deepcopy(tensors.state_dict()))
    back_schedule.load_state_dict(flat_schedule.state_dict())
    load_weights(back, flat.masters)
    assert_same_update(back, flat, tol=0.0)
    for opt, schedule in ((flat, flat_schedule), (tensors, tensors_schedule), (back, back_schedule)):
        train(_model_of(opt), opt, schedule, 2, seed=3)
    assert_same_update(back, flat, tol=0.0)
    assert_same_update(back, tensors)
    assert all(p.abs().max() == 0 for p in padding(back))


def test_its_own_state_dict_loads_back_unchanged():
    """torch's load keeps tensors of the right dtype and device as they are, so this state_dict's moments are
    views of the buffers they are loaded into."""
    model, opt, schedule = build("flat")
    train(model, opt, schedule, 2)
    before = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(opt.state_dict())
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], before["state"][i][k]) for i in after for k in after[i])
    assert opt.inner.exp_avg.abs().max() > 0


def test_used_alone_it_is_lamb_on_the_parameters_gradients():
    """Outside MasterWeights (rows of 8, an empty group): the same steps as Lamb(capturable=True) from each
    parameter's own .grad."""
    torch.manual_seed(0)
    weights = [torch.randn(5, 7), torch.randn(3)]
    flat_params, ref_params = ([w.clone() for w in weights] for _ in range(2))
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1}, {"params": []},  # noqa: E731
                         {"params": ps[1:], "weight_decay": 0.0}]
    flat = FlatLamb(groups(flat_params), lr=torch.tensor(0.1), chunk=ROW)
    ref = Lamb(groups(ref_params), lr=torch.tensor(0.1), capturable=True)
    for k in range(3):
        for a, b in zip(flat_params, ref_params):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(k))
            b.grad = a.grad.clone()
        flat.step()
        ref.step()
        assert all((a - b).abs().max() < 1e-6 for a, b in zip(flat_params, ref_params))
    assert all((a - w).abs().max() > 0.1 for a, w in zip(flat_params, weights))


@pytest.mark.parametrize("decays", [(0.1, 0.0), (0.0, 0.0), (0.1, 0.1)], ids=["one-decays", "none", "both"])
def test_each_row_takes_its_own_groups_lr_and_update_count(decays):
    """One pass over every group's rows (rows of 8): the groups' LRs differ (0.05, 0.01) and so do their update
    counts (3 and 2: a Lamb checkpoint whose second group once had no gradient), so each tensor must take its own
    group's LR and each row its own group's bias corrections; weight decay in one group, in none or in both."""
    torch.manual_seed(0)
    weights = [torch.randn(5, 7), torch.randn(3), torch.randn(4, 4)]

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [{"params": ps[:1], "weight_decay": decays[0], "lr": torch.tensor(0.05)},
                {"params": ps[1:], "weight_decay": decays[1], "lr": torch.tensor(0.01)}]

    def gradients(ps: list[torch.Tensor], k: int, skip_second: bool = False) -> None:
        for i, t in enumerate(ps):
            t.grad = None if skip_second and i > 0 else torch.randn(t.shape, generator=torch.Generator().manual_seed(k))

    first = Lamb(groups(weights), lr=torch.tensor(0.1), betas=(0.8, 0.9), capturable=True)
    for k in range(3):
        gradients(weights, k, skip_second=k == 0)
        first.step()
    saved = first.state_dict()
    assert sorted(float(s["step"]) for s in saved["state"].values()) == [2.0, 2.0, 3.0]
    flat_params, ref_params = ([w.detach().clone() for w in weights] for _ in range(2))
    flat = FlatLamb(groups(flat_params), lr=torch.tensor(0.1), betas=(0.8, 0.9), chunk=ROW)
    ref = Lamb(groups(ref_params), lr=torch.tensor(0.1), betas=(0.8, 0.9), capturable=True)
    flat.load_state_dict(saved)
    ref.load_state_dict(saved)
    for k in range(3, 6):
        gradients(flat_params, k)
        gradients(ref_params, k)
        flat.step()
        ref.step()
        assert all((a - b).abs().max() < 1e-6 for a, b in zip(flat_params, ref_params))
    assert all((a - w).abs().max() > 1e-3 for a, w in zip(flat_params, weights))


def test_an_empty_state_loads_as_a_fresh_one():
    model, opt, schedule = build("flat")
    fresh = opt.state_dict()
    train(model, opt, schedule, 2)
    opt.load_state_dict(fresh)
    assert not any(opt.inner.state.values())
    assert opt.inner.exp_avg.abs().max() == 0 and opt.inner.exp_avg_sq.abs().max() == 0


def test_a_tensor_without_a_gradient_is_an_error_naming_the_setting():
    model, opt, _ = build("flat")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].bias.grad = None
    with pytest.raises(ValueError, match="OPTIMIZER_LAYOUT=tensors"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    kept = [m.clone() for m in opt.masters]
    opt.step()  # no gradient at all: nothing to do, as for the per-tensor layout
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, kept))


def test_the_compiled_update_equals_the_eager_one():
    """COMPILE_OPTIMIZER=1 on the flat layout (the CPU compiles with aot_eager: the capture, not inductor's code);
    the warm-up leaves the masters, the model and the state as they were."""
    torch._dynamo.reset()
    (model, opt, schedule), (ref_model, ref, ref_schedule) = build("flat"), build("flat")
    compile_step(opt, "debug")
    for p in model.parameters():
        p.grad = None
    start = [m.clone() for m in opt.masters]
    warm_up_step(opt)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, start)) and not opt.inner.exp_avg.abs().max()
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(opt.params, opt.masters))
    train(model, opt, schedule, 3)
    train(ref_model, ref, ref_schedule, 3)
    assert_same_update(opt, ref)


def test_the_config_builds_the_flat_layout_on_rows_of_2048():
    model = nn.Sequential(nn.Linear(64, 40), nn.LayerNorm(40))  # a 2,560-element weight: two rows
    opt = build_optimizer(model, config("flat").optim, torch.bfloat16)
    assert isinstance(opt.inner, FlatLamb) and opt.layout.chunk == 2048 and opt.layout.counts == [2, 1, 1, 1]
    assert model[0].weight.dtype == torch.bfloat16 and opt.masters[0].dtype == torch.float32


def test_driver_steps_and_checkpoint_match_the_per_tensor_layout(world_of_one, tmp_path):
    """The driver's pieces (DDP, `after` clip in the step, schedule) on a micro BERT: train_step under both layouts
    stays within fp32 rounding; the flat run's checkpoint (safetensors of the masters, state per tensor) resumes
    the per-tensor layout and the flat one alike, each continuing as the run that was never stopped."""
    flat, tensors = (build_run(config_mw("lamb", "after", optimizer_layout=layout)) for layout in ("flat", "tensors"))
    assert isinstance(flat.optimizer.inner, FlatLamb) and not isinstance(tensors.optimizer.inner, FlatLamb)
    for step in range(STEPS):
        for run in (flat, tensors):
            train_step(run, iter(batches(step)))
        assert_same_update(flat.optimizer, tensors.optimizer, tol=1e-5)
    parts = {"optimizer": flat.optimizer, "schedule": flat.schedule, "scaler": flat.scaler}
    where = save_checkpoint(tmp_path, STEPS, flat.ddp.module, parts, 0, {})
    resumed = {}
    for layout in ("flat", "tensors"):
        run = resumed[layout] = build_run(config_mw("lamb", "after", optimizer_layout=layout), seed=1)
        load_checkpoint(where, run.ddp.module, {"optimizer": run.optimizer, "schedule": run.schedule,
                                                "scaler": run.scaler}, 0, {})
        assert_same_update(run.optimizer, flat.optimizer, tol=0.0)
    for step in range(STEPS, STEPS + 2):
        for run in (flat, *resumed.values()):
            train_step(run, iter(batches(step)))
    assert_same_update(resumed["flat"].optimizer, flat.optimizer, tol=0.0)
    assert_same_update(resumed["tensors"].optimizer, flat.optimizer, tol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (inductor's CUDA code for the flat update)")
def test_cuda_compiled_flat_update_equals_the_eager_per_tensor_one():
    """COMPILE_OPTIMIZER=1 as the H100 configs run it (inductor, no CUDA graphs) on the flat layout, against the
    eager per-tensor layout on the same GPU, over a BERT-sized spread of tensors (a 2,048-element row, tensors of
    1,024 to 3 M elements)."""
    torch._dynamo.reset()
    runs = []
    for layout in ("flat", "tensors"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 3072), nn.LayerNorm(3072), nn.Linear(3072, 1024)).cuda()
        opt = build_optimizer(model, config(layout).optim, torch.bfloat16)
        schedule = build_schedule(opt, config(layout).optim)
        if layout == "flat":
            compile_step(opt, "default")
        runs.append((model, opt, schedule))
    for model, opt, schedule in runs:
        for k in range(3):
            gen = torch.Generator(device="cuda").manual_seed(k)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
    assert_same_update(runs[0][1], runs[1][1], tol=1e-5)


@pytest.mark.parametrize("name, autotune", [("default", False), ("max-autotune-no-cudagraphs", True),
                                            ("reduce-overhead", False)])
def test_the_flat_update_is_compiled_without_inductors_loop_reordering(monkeypatch, name, autotune):
    """torch 2.11's inductor asserts in its loop reordering on the flat update on CUDA (bert.optim.compiled): the
    flat update is compiled with the mode's own options (no CUDA graphs) and that pass off; the per-tensor one
    keeps the plain mode."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compile_step(build("flat")[1], name)
    compile_step(build("tensors")[1], name)
    flat, tensors = calls
    reindexing = ({"loop_reindexing_after_fusion": False} if hasattr(torch._inductor.config,
                                                                     "loop_reindexing_after_fusion") else {})
    assert flat == {"backend": "inductor", "options": {"loop_ordering_after_fusion": False, **reindexing,
                                                       **({"max_autotune": True, "coordinate_descent_tuning": True}
                                                          if autotune else {})}}
    assert tensors == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs" if autotune else "default"}
