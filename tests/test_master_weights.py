"""Master weights (bert.optim.master): a bf16/fp16 model, fp32 masters and state in the optimizer.

References, all independent of `MasterWeights`:
  * the update: the plain fp32 optimizer (bert.optim, tested against float64 in test_optim.py) applied to the
    model's gradients cast to fp32 (and unscaled by its own GradScaler under fp16). The masters must equal
    it bit for bit, and the model's weights must be the masters rounded to the compute dtype, so they are
    within one rounding of that fp32-weight reference: |w - w_ref| <= u |w_ref|, with u the unit roundoff
    of round-to-nearest (2^-8 for bf16's 8-bit significand, 2^-11 for fp16's 11); under fp16 with overflowed
    steps (the first among them) the reference skips on the host, as GradScaler does, and the masters, which
    skip on the device, must still equal it bit for bit (on a GPU: the CPU's run within fp32 rounding);
  * N steps of the loop's `train_step` through the pieces the driver builds (DDP or balanced fusion
    buffers, `install_clipping` with `hook_clip_mode`, the LR schedule, the GradScaler, gradient
    accumulation) against a run written out by hand: fp32 weights, each step's forward and backward on a
    copy cast with `.to(dtype)`, the gradients cast up and given to the plain optimizer. `before` and
    `bucket` clip inside DDP's hook, on the compute-dtype buckets; there the reference takes the
    gradients the hook left (captured at the step) and checks the clip by its bound;
    After the steps, eval on the compute-dtype model (autocast off) equals the reference cast down;
  * train_step multiplies the loss by the Clipper's loss_factor (the 1/W where the hooks only sum);
  * checkpoints: save, load into a model built from another seed, continue == never interrupted; the file
    holds the fp32 masters, and a plain fp32 run (MASTER_WEIGHTS=0) loads the same weights and state;
  * the parse-time refusals (fp32; OPTIMIZER_SHARDING=1 needs the flat layout, tests/test_sharded_master.py), one
    line each; COMPILE_OPTIMIZER=1 parses with it (the compiled update: tests/test_optim_compiled.py).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from bert.config import ConfigError, from_env_and_args, from_flat
from bert.dist.clip import ClipAfterAllreduce, install_clipping
from bert.dist.ddp import apply_ddp
from bert.dist.reduce import mean_placement
from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import save_weights
from bert.model.precision import autocast_dtype, compute_dtype
from bert.optim import build_optimizer, build_schedule, hook_clip_mode
from bert.optim.master import MasterWeights
from bert.synthetic import random_batch
from bert.train.build import autocast_for, build_model
from bert.train.checkpoint import load_checkpoint, save_checkpoint
from bert.train.evaluate import evaluate
from bert.train.loop import train_step

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff: |fl(x) - x| <= u |x|
VOCAB = 1024  # synthetic words start at id 999
MICRO = replace(BertConfig.load("tiny"), vocab_size=VOCAB, real_vocab_size=VOCAB, hidden_size=32, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64).with_dropout(0.0)
C, STEPS, SCALE = 0.5, 3, 2.0**10


pytestmark = pytest.mark.usefixtures("one_thread")


def micro_bert(seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(MICRO, attention="loop")


def config(optimizer: str = "lamb", clip: str = "after", master: bool = True, precision: str = "bf16", **extra):
    return from_flat(learning_rate=0.02, max_steps=10, warmup_steps=2, optimizer=optimizer, grad_clip=clip,
                     max_grad_norm=C, weight_decay_rate=0.1, master_weights=master, precision=precision, **extra)


def batches(step: int, micro_steps: int = 1):
    return [random_batch((13, 7, 20), seed=10 * step + k, vocab_size=VOCAB) for k in range(micro_steps)]


def params(model) -> list[torch.Tensor]:
    return [p for p in model.parameters()]


def in_group_order(optimizer) -> list[torch.Tensor]:
    """The parameters in the order the optimizer holds them (and its masters): decay group, then no-decay."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def assert_within_one_rounding(model, reference, dtype) -> None:
    """The model's weights are the masters rounded to `dtype`: exactly reference.to(dtype) when the masters equal
    the reference, hence within u |w_ref| of it, or half the subnormal spacing eta below the normal range."""
    eta = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    for p, r in zip(params(model), params(reference)):
        assert p.dtype == dtype and torch.equal(p, r.detach().to(dtype))
        assert bool(((p.double() - r.double()).abs() <= U[dtype] * r.double().abs() + eta / 2).all())


# -- the update itself --------------------------------------------------------------------------------------


def test_precision_decides_the_compute_and_autocast_dtypes():
    """The one rule the driver, its record and the benchmarks share (bert.model.precision)."""
    from bert.model.precision import autocast_dtype, compute_dtype

    assert [compute_dtype(p) for p in ("fp32", "bf16", "fp16", "fp8")] == [
        torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    assert [autocast_dtype(p) for p in ("fp32", "bf16", "fp16", "fp8")] == [None, torch.bfloat16, torch.float16,
                                                                           torch.bfloat16]
    assert autocast_dtype("bf16", master_weights=True) is None and autocast_dtype("fp16", True) is None
    with autocast_for("bf16", torch.device("cpu"), master_weights=True)():
        assert not torch.is_autocast_enabled("cpu")
    with autocast_for("bf16", torch.device("cpu"))():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_masters_are_the_fp32_initialisation_and_the_model_is_cast(tmp_path):
    """INIT_CHECKPOINT: fp32 values that bf16 cannot hold come through build_model into the masters unrounded."""
    (tmp_path / "micro.json").write_text(json.dumps(MICRO.to_dict()))
    save_weights(micro_bert(5), tmp_path / "init.safetensors")
    cfg = from_flat(bert_config_path=str(tmp_path / "micro.json"), init_checkpoint=str(tmp_path / "init.safetensors"),
                    attention="loop")
    model = build_model(cfg.model, torch.device("cpu"))
    opt = build_optimizer(model, config().optim, torch.bfloat16)
    saved = load_file(tmp_path / "init.safetensors")
    by_id = {id(p): m for p, m in zip(opt.params, opt.masters)}
    for name, p in model.named_parameters():
        assert torch.equal(by_id[id(p)], saved[name]) and by_id[id(p)].dtype == torch.float32, name
        assert torch.equal(p, saved[name].to(torch.bfloat16)), name
    assert any(not torch.equal(saved[n].to(torch.bfloat16).float(), saved[n]) for n in saved)  # bf16 would lose bits


@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
@pytest.mark.parametrize("dtype, overflows", [(torch.bfloat16, ()), (torch.float16, ()), (torch.float16, (0, 2))])
def test_master_update_is_the_plain_fp32_optimizer_on_the_cast_gradients(optimizer, dtype, overflows):
    """fp16 with `overflows`: an inf gradient at the first step, a NaN at the third. The masters skip them on the
    device (no host sync: bert.optim.master), the plain optimizer as GradScaler skips, on the host for LAMB and in
    the fused kernel for AdamW; the masters must still equal it bit for bit at every step, a first step skipped
    (LAMB's update count left at 0) included."""
    fp16 = dtype == torch.float16
    reference, model = micro_bert(), micro_bert()
    ref_opt = build_optimizer(reference, config(optimizer, master=False).optim)
    opt = build_optimizer(model, config(optimizer).optim, dtype)
    assert isinstance(opt, MasterWeights) and hook_clip_mode(config(optimizer).optim) == "none"
    schedules = [build_schedule(o, config(optimizer).optim) for o in (ref_opt, opt)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=fp16) for _ in range(2)]
    for s in scalers:
        s.scale(torch.ones(()))  # the loop scales the loss first; that creates the scale tensor
    # the plain path's `after`, over the parameters in the optimizer's order (ClipAfterAllreduce takes DDP's,
    # the model's order: the fp32 norm would sum the same squares in another order)
    clip_ref = ClipAfterAllreduce(in_group_order(ref_opt), C)
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS + len(overflows)):
        for p, r in zip(params(model), params(reference)):
            p.grad = (torch.randn(p.shape, generator=gen) * scalers[1].get_scale()).to(dtype)
            if step in overflows and p is params(model)[3]:
                p.grad[0] = float("inf") if step == overflows[0] else float("nan")
            r.grad = p.grad.float()
        clip_ref.before_step(ref_opt, scalers[0])
        for o, s, sched in zip((ref_opt, opt), scalers, schedules):
            s.step(o)
            s.update()
            sched.step()
            o.zero_grad(set_to_none=True)
        for m, r in zip(opt.masters, in_group_order(ref_opt)):
            assert torch.equal(m, r)
        assert_within_one_rounding(model, reference, dtype)
        assert all(p.grad is None for p in params(model)) and all(m.grad is None for m in opt.masters)
    assert scalers[1].get_scale() == scalers[0].get_scale() == (SCALE / 2 ** len(overflows) if fp16 else 1.0)
    assert not torch.equal(opt.masters[0], micro_bert().bert.embeddings.word_embeddings.weight)  # it trained


@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_fp16_overflow_skips_the_whole_step_on_the_device_and_backs_off_the_scale(optimizer):
    """The step runs (no host sync decides), and changes nothing: the masters, the model's weights, and the inner
    state it creates is a fresh one in value (update count 0, zero moments)."""
    model = micro_bert()
    opt = build_optimizer(model, config(optimizer).optim, torch.float16)
    build_schedule(opt, config(optimizer).optim)
    assert opt.skips_on_device
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    before = [m.clone() for m in opt.masters], [p.detach().clone() for p in params(model)]
    for p in params(model):
        p.grad = torch.ones_like(p)
    params(model)[3].grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2
    assert all(torch.equal(a, b) for a, b in zip(before[0], opt.masters))
    assert all(torch.equal(a, b) for a, b in zip(before[1], params(model)))
    state = [opt.inner.state[m] for m in opt.masters]
    assert all(s["step"] == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_cuda_fp16_overflow_is_skipped_on_the_device(optimizer):
    """The GPU's kernels for the skip (LAMB: foreach lerp with device weights, fp32 bias corrections from a float64
    count; AdamW: the fused kernel's own): steps with an inf at the first and a NaN at the third gradient, against
    the same steps on the CPU (equal to the plain optimizer bit for bit, above) within fp32 rounding; a skipped step
    leaves the masters exactly as they were."""
    def run(device: str) -> list[list[torch.Tensor]]:
        model = micro_bert().to(device)
        opt = build_optimizer(model, config(optimizer).optim, torch.float16)
        schedule = build_schedule(opt, config(optimizer).optim)
        assert opt.skips_on_device
        scaler = torch.amp.GradScaler(device, init_scale=SCALE)
        scaler.scale(torch.ones((), device=device))
        gen, after = torch.Generator().manual_seed(3), [[m.detach().cpu().clone() for m in opt.masters]]
        for step in range(5):
            for p in params(model):
                p.grad = (torch.randn(p.shape, generator=gen) * scaler.get_scale()).to(device, torch.float16)
            if step in (0, 2):
                params(model)[3].grad[0] = float("inf") if step == 0 else float("nan")
            scaler.step(opt)
            scaler.update()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            after.append([m.detach().cpu().clone() for m in opt.masters])
        assert scaler.get_scale() == SCALE / 4
        return after  # the masters at the start and after each step

    cpu, gpu = run("cpu"), run("cuda")
    for skipped in (1, 3):  # the first and the third step
        assert all(torch.equal(a, b) for a, b in zip(gpu[skipped - 1], gpu[skipped]))
    for step in range(6):
        for a, b in zip(cpu[step], gpu[step]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_fp16_overflow_is_checked_on_the_host_where_the_inner_optimizer_cannot_skip():
    """apex's FusedLAMB or the foreach AdamW of a compiled step take no `found_inf`: the host check skips the
    step before anything runs (the inner optimizer never steps)."""
    model = micro_bert()
    opt = build_optimizer(model, config("adam", compile_optimizer=True, compile="debug").optim, torch.float16)
    assert not opt.skips_on_device
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    before = [m.clone() for m in opt.masters]
    for p in params(model):
        p.grad = torch.ones_like(p)
    params(model)[3].grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2 and not opt.inner.state
    assert all(torch.equal(a, b) for a, b in zip(before, opt.masters))


# -- N steps of the loop ------------------------------------------------------------------------------------


def build(cfg, seed: int = 0):
    """What build_run builds, in its order: model, optimizer (casts it), DDP, clipping, schedule, scaler."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.model.precision]
    model = micro_bert(seed)
    optimizer = build_optimizer(model, cfg.optim, dtype)
    ddp = apply_ddp(model, replace(cfg.dist, bucket_cap_mb=0.02))  # 20 kB: several buckets
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=dtype == torch.float16)
    clipper = install_clipping(ddp, hook_clip_mode(cfg.optim), C, scaler,
                               mean_at=mean_placement(cfg.model.precision, False))  # as bert.train.build
    schedule = build_schedule(optimizer, cfg.optim)
    return SimpleNamespace(cfg=cfg, ddp=ddp, clipper=clipper, optimizer=optimizer, schedule=schedule, scaler=scaler,
                           autocast=autocast_for(cfg.model.precision, torch.device("cpu"), True), dtype=dtype)


def reference_step(ref, ref_opt, ref_sched, step: int, dtype, clip: str, micro_steps: int, captured=None) -> float:
    """fp32 weights; forward/backward on a `.to(dtype)` copy (no autocast); gradients cast up, unscaled and (after)
    clipped in fp32; the plain optimizer. With `captured` (before/bucket), the hook-clipped gradients instead.
    Returns the fp32 gradient's norm before the step."""
    scale = SCALE if dtype == torch.float16 else 1.0
    targets = params(ref) if captured is None else in_group_order(ref_opt)  # `captured` is in the optimizer's order
    if captured is None:
        low = copy.deepcopy(ref).to(dtype)
        for batch in batches(step, micro_steps):
            (low(batch).loss / micro_steps * scale).backward()
        captured = [p.grad for p in params(low)]
    inv = torch.tensor(scale).double().reciprocal().float()
    for r, g in zip(targets, captured):
        r.grad = g.float() * inv
    norm = torch.nn.utils.get_total_norm([r.grad for r in params(ref)])
    if clip == "after":
        torch.nn.utils.clip_grad_norm_(in_group_order(ref_opt), C, foreach=True)
    ref_opt.step()
    ref_sched.step()
    ref_opt.zero_grad(set_to_none=True)
    return float(norm)


CASES = [  # optimizer, precision, clip, buckets, micro-steps
    ("lamb", "bf16", "after", "ddp", 1), ("adam", "bf16", "none", "balanced", 2),
    ("lamb", "fp16", "after", "balanced", 1), ("adam", "fp16", "none", "ddp", 2),
    ("lamb", "bf16", "before", "ddp", 1), ("adam", "bf16", "bucket", "balanced", 1),
    ("lamb", "fp16", "bucket", "ddp", 1),
]


@pytest.mark.parametrize("optimizer, precision, clip, buckets, micro_steps", CASES)
def test_train_steps_equal_the_mixed_precision_reference(world_of_one, optimizer, precision, clip, buckets,
                                                         micro_steps):
    cfg = config(optimizer, clip, precision=precision, grad_buckets=buckets, gradient_accumulation_steps=micro_steps)
    run = build(cfg)
    reference = micro_bert()
    ref_opt = build_optimizer(reference, config(optimizer, master=False).optim)
    ref_sched = build_schedule(ref_opt, cfg.optim)
    in_hook = clip in ("before", "bucket")
    captured: list[list[torch.Tensor]] = []
    norms: list[float] = []
    run.optimizer.register_step_pre_hook(lambda o, *_: captured.append([p.grad.clone() for p in o.params]))
    for step in range(STEPS):
        loss = train_step(run, iter(batches(step, micro_steps)))
        assert loss.dtype == torch.float32 and math.isfinite(loss.item())
        if in_hook:  # the hook clipped the compute-dtype buckets: to C, or C/sqrt(B) each, so the whole is <= C
            norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in captured[-1]]))
            scale = SCALE if precision == "fp16" else 1.0
            # the factor and each product are rounded to the compute dtype (u each); fp32 norms and factor add
            # a few 2^-24 (bounded here by 2^-20)
            assert norm / scale <= C * (1 + U[run.dtype]) ** 2 * (1 + 2.0**-20)
        norms.append(reference_step(reference, ref_opt, ref_sched, step, run.dtype, clip, micro_steps,
                       captured[-1] if in_hook else None))
        for m, r in zip(run.optimizer.masters, in_group_order(ref_opt)):
            assert torch.equal(m, r)
        assert_within_one_rounding(run.ddp.module, reference, run.dtype)
    assert run.scaler.get_scale() == (SCALE if precision == "fp16" else 1.0)  # no step was skipped
    if clip == "after":
        assert norms[0] > C  # the clip had something to do
    # eval runs the compute-dtype model as it is (autocast off): the same counts as the reference cast down
    held_out = [random_batch((11, 24), seed=99, vocab_size=VOCAB)]
    with torch.no_grad():
        expected = copy.deepcopy(reference).to(run.dtype).eval()(held_out[0])
    assert evaluate(run.ddp.module, held_out, run.autocast()) == int(expected.mlm_correct) / int(expected.mlm_total)
    with torch.no_grad(), run.autocast():
        assert torch.equal(run.ddp.module.eval()(held_out[0]).loss, expected.loss)  # not only a count that may be 0


def test_checkpoint_holds_the_masters_and_resume_is_exact(world_of_one, tmp_path):
    cfg = config("lamb", "after", precision="bf16")
    whole = build(cfg)
    for step in range(2 * STEPS):
        train_step(whole, iter(batches(step)))
        if step == STEPS - 1:
            parts = {"optimizer": whole.optimizer, "schedule": whole.schedule, "scaler": whole.scaler}
            where = save_checkpoint(tmp_path, STEPS, whole.ddp.module, parts, 0, {})
            saved = load_file(where / "model.safetensors")
    resumed = build(cfg, seed=1)  # other weights: the load must overwrite every one
    load_checkpoint(where, resumed.ddp.module, {"optimizer": resumed.optimizer, "schedule": resumed.schedule,
                                                "scaler": resumed.scaler}, 0, {})
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for p in params(resumed.ddp.module))  # the model got its bf16 storage back
    named = dict(resumed.ddp.module.named_parameters())
    masters = {id(p): m for p, m in zip(resumed.optimizer.params, resumed.optimizer.masters)}
    assert all(torch.equal(masters[id(named[n])], saved[n]) for n in named)  # the file's fp32 values, unrounded
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in saved.values())  # they are not bf16 values
    # the same checkpoint resumes a plain fp32 run (MASTER_WEIGHTS=0): the masters and state are its weights and state
    plain = micro_bert(2)
    plain_opt = build_optimizer(plain, config(master=False).optim)
    load_checkpoint(where, plain, {"optimizer": plain_opt, "schedule": build_schedule(plain_opt, cfg.optim)}, 0, {})
    assert all(torch.equal(p, saved[n]) for n, p in plain.named_parameters())
    ours, theirs = resumed.optimizer.state_dict()["state"], plain_opt.state_dict()["state"]
    same = lambda a, b: torch.equal(a, b) if torch.is_tensor(a) else a == b  # noqa: E731  (LAMB's step is an int)
    assert ours.keys() == theirs.keys() and all(same(ours[i][k], theirs[i][k]) for i in ours for k in ours[i])
    for step in range(STEPS, 2 * STEPS):
        train_step(resumed, iter(batches(step)))
    for a, b in zip(whole.optimizer.masters, resumed.optimizer.masters):
        assert torch.equal(a, b)
    for a, b in zip(params(whole.ddp.module), params(resumed.ddp.module)):
        assert torch.equal(a, b)



def test_train_step_scales_the_loss_by_the_clippers_loss_factor(world_of_one):
    """Where the comm hooks only sum, the mean's 1/W rides on the loss (bert.dist.reduce): the gradient the
    optimizer sees is scaled by `loss_factor` (by 1/4: exact in binary), the loss the loop reports is not."""
    grads, losses = {}, {}
    for factor in (1.0, 0.25):
        run = build(config("adam", "none"))
        run.clipper.loss_factor = factor

        def capture(optimizer, *_, f=factor) -> None:
            grads[f] = [p.grad.clone() for p in optimizer.params]

        run.optimizer.register_step_pre_hook(capture)
        losses[factor] = train_step(run, iter(batches(0))).item()
    assert losses[0.25] == losses[1.0]
    assert all(torch.equal(a * 0.25, b) and a.any() for a, b in zip(grads[1.0], grads[0.25]))


# -- the config -----------------------------------------------------------------------------------------------

BASE = {"DATADIR_PHASE2": "/d", "EVALDIR": "/e", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
        "MAX_STEPS": "10"}


@pytest.mark.parametrize("env, message", [
    ({"MASTER_WEIGHTS": "1"}, r"--master_weights / \$MASTER_WEIGHTS = True needs PRECISION=bf16, fp16 or fp8, not "
                              "fp32"),
    ({"MASTER_WEIGHTS": "1", "PRECISION": "bf16", "OPTIMIZER_SHARDING": "1"},
     r"\$OPTIMIZER_LAYOUT = 'tensors' must be flat with MASTER_WEIGHTS=1 and OPTIMIZER_SHARDING=1"),
    ({"MASTER_WEIGHTS": "yes please"}, r"\$MASTER_WEIGHTS = 'yes please' from \$MASTER_WEIGHTS is not a valid bool"),
])
def test_unsupported_combinations_are_refused_at_parse_time(env, message):
    with pytest.raises(ConfigError, match=message) as err:
        from_env_and_args([], {**BASE, **env})
    assert "\n" not in str(err.value)


def test_supported_combinations_parse():
    for precision in ("bf16", "fp16"):
        for clip in ("after", "before", "bucket", "none"):
            cfg = from_env_and_args([], {**BASE, "MASTER_WEIGHTS": "1", "PRECISION": precision, "GRAD_CLIP": clip,
                                         "GRAD_BUCKETS": "balanced", "GRAD_REDUCE": "hierarchical"})
            assert cfg.optim.master_weights and hook_clip_mode(cfg.optim) == ("none" if clip == "after" else clip)
        cfg = from_env_and_args([], {**BASE, "MASTER_WEIGHTS": "1", "PRECISION": precision, "COMPILE": "debug",
                                     "COMPILE_OPTIMIZER": "1"})
        assert cfg.optim.master_weights and cfg.optim.compile_optimizer
    # fp8: bf16 weights whose encoder linears run float8 GEMMs (bert.model.fp8)
    cfg = from_env_and_args([], {**BASE, "MASTER_WEIGHTS": "1", "PRECISION": "fp8", "STATIC_TOKENS": "512"})
    assert cfg.optim.master_weights and autocast_dtype("fp8", True) is None and compute_dtype("fp8") == torch.bfloat16
