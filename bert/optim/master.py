"""Master weights (`MASTER_WEIGHTS=1`): the model holds bf16/fp16 weights, the optimizer holds them in fp32.
(PRECISION=fp8 holds bf16 weights: its float8 GEMMs cast their operands themselves, bert.model.fp8.)

This is how the submissions run mixed precision ([NVIDIA-BERT]: the model cast to fp16/bf16, an fp32
master copy and fp32 state inside the fused LAMB), in place of autocast over fp32 weights, which casts
every weight down at every forward (and LayerNorm's inputs back up) -- about 11 % of an H100 step.

    model     every trainable parameter in the compute dtype; forward and backward run in it with
              autocast off (bert.train.build), so the gradients DDP reduces and the clipping hooks
              see are in that dtype too (their norms are taken in fp32: bert.dist.clip.local_norm)
    masters   fp32 copies, made from the fp32 initialisation (random or INIT_CHECKPOINT) by the
              constructor, which only then casts the model: nothing is lost at init
    step      1. the model's gradients are cast into fp32 master gradients (one foreach copy; fp16: into
                 one flat buffer; they live only during the step, so their memory goes back to the activations)
              2. fp16: divided by the GradScaler's scale (a power of two: exact); on overflow, zeroed, and
                 the inner optimizer told to change nothing (below)
              3. GRAD_CLIP=after: clipped by their global norm, in fp32 (`hook_clip_mode` moves the
                 mode here, as for sharding: GradScaler cannot unscale fp16 gradients in place)
              4. the inner optimizer (foreach LAMB, apex FusedLAMB, fused AdamW) updates the masters
                 and its fp32 state, with the hyperparameters (the schedule's LR tensor) copied from
                 this optimizer's groups
              5. the masters are copied into the model's weights (foreach copy: round to nearest)
              No host sync: an overflowed fp16 step is skipped on the device.
    flat      OPTIMIZER_LAYOUT=flat (bert.optim.flat): the masters, the fp32 gradients and the model's weights
              are views of three buffers of one layout, so steps 1, 2 and 5 are a pass each over one buffer,
              the clip's norm is one buffer's, and the inner LAMB works on whole rows

The skip without a host sync: GradScaler leaves its inf flag on the device, and reading it on the host
(`.item()`) would make the host wait for the whole backward every step, so the next step's launches could
no longer run ahead of the GPU (and no CUDA graph could hold the step). The flag goes into the update instead:
the flat fp32 gradient is zeroed where it is set (one pass; inf x 0 would be NaN), and the inner optimizer,
told `found_inf` as torch's fused optimizers are, leaves the masters and its state as they were. Two inner
optimizers can: our LAMB with its update count on the device (`build_optimizer` builds it so under fp16; every
moving factor becomes 0, bert.optim.lamb) and torch's fused AdamW (inside its kernel). For apex's FusedLAMB
(chosen where installed: its two fused kernels outweigh the sync) and the foreach AdamW of a compiled step, which
cannot, the flag is read on the host and the step not run (`skips_on_device`). Either way the masters, the
weights and the moments equal the plain fp32 optimizer's under GradScaler's host-side skip, bit for bit
(tests/test_master_weights.py, a first step skipped included).

COMPILE_OPTIMIZER=1 compiles steps 1-5 as one function (`update_masters`; bert.optim.compiled), so
inductor fuses the cast up, the unscale, the skip, the clip, the inner update and the copy back into a few
kernels instead of ~20 foreach launches over every tensor. Under OPTIMIZER_LAYOUT=flat the cast up (step 1) runs
before it, in `step`: inside a graph, each write into a view of the flat gradient became a temporary and a copy back
into the buffer (317 Triton kernels for BERT-large, against 13 without, bench/gpu_compile.py). The inner optimizer
is then the capturable one (LAMB's update count on the device), and the scale, the inf flag and the LR reach the
compiled code as tensors, so no step recompiles.

So the masters after a step are exactly what the plain fp32 optimizer makes from the fp32-cast gradients,
and the model's weights are the masters rounded to the compute dtype (tests/test_master_weights.py); compiled,
the masters are within fp32 rounding of the eager ones (inductor reorders sums; tests/test_optim_compiled.py).

fp16: the GradScaler hands its scale and inf flag to `step` (`_step_supports_amp_scaling`); it checks
the fp16 gradients for inf/NaN itself first (a device op). The scaled gradients are fp16 now, so scale x |g|
above 65504 overflows: the step is skipped and the scale halved, and the dynamic scale settles lower than
with fp32 gradients (a CPU run from INIT_LOSS_SCALE=2^16 skipped its first step). bf16 needs no scale.

Checkpoints: `state_dict` is the inner optimizer's, laid out as the plain optimizer's (same indices over
the same parameter order), so a checkpoint moves between MASTER_WEIGHTS=0 and 1. The weights file holds
the masters: `fp32_weights(optimizer)` makes the masters the model's tensors while the checkpoint code
saves or loads the model (bert.train.checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor

from bert.dist.clip import clip_after_allreduce, clip_factor
from bert.optim.flat import FlatLayout, check_every_gradient, move_into
from bert.optim.lamb import Lamb

Groups = list[dict]
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


class MasterWeights(torch.optim.Optimizer):
    """An optimizer over the model's compute-dtype parameters that runs `inner` on fp32 masters.

    Its param_groups are the model's parameters (the GradScaler, `zero_grad` and the schedule see an
    ordinary optimizer); `inner` is built by `build_inner` over the masters, group for group.
    """

    _step_supports_amp_scaling = True  # GradScaler.step passes grad_scale / found_inf instead of unscaling

    def __init__(self, groups: Groups, build_inner: Callable[[Groups], torch.optim.Optimizer],
                 compute_dtype: torch.dtype, clip_after: float | None = None):
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"master weights need a bf16 or fp16 model, got {compute_dtype}")
        self.params: list[Tensor] = [p for g in groups for p in g["params"]]
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("master weights are copied from fp32 parameters: build the optimizer before the "
                             "model is cast")
        with torch.no_grad():
            self.masters = [p.detach().clone() for p in self.params]
            for p in self.params:
                p.data = p.data.to(compute_dtype)  # the same Parameter objects: groups, hooks and DDP keep them
        master_groups, i = [], 0
        for g in groups:
            k = len(g["params"])
            master_groups.append({**g, "params": self.masters[i:i + k]})
            i += k
        self.inner = build_inner(master_groups)
        # OPTIMIZER_LAYOUT=flat (bert.optim.flat): the inner optimizer has moved the masters into one buffer; the
        # model's weights go into one of the same layout, so the copy back is one pass over it
        self.layout: FlatLayout | None = getattr(self.inner, "layout", None)
        self.low = move_into(self.params, self.layout, compute_dtype) if self.layout else None
        if self.layout:
            self.inner.grads_in_place = True  # `step` casts the gradients into its `grad_views`
        self.clip_after = clip_after
        self.compute_dtype = compute_dtype
        # what `step` runs after its host-side checks; COMPILE_OPTIMIZER=1 replaces it by its compiled form
        # (bert.optim.compiled.compile_step)
        self.update_masters = self._update_masters
        super().__init__(groups, self.inner.defaults)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("MasterWeights.step does not take a closure")
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step under fp16 only
        scaled = found_inf is not None
        if scaled and not self.skips_on_device:
            if found_inf.item():  # overflow, seen on the host: skip, as GradScaler does (and update() backs off)
                return
            found_inf = None
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        if not pairs or (self.layout and not check_every_gradient(self.params)):
            return
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        # as GradScaler.unscale_: 1 / scale in float64, then fp32 (a power of two: exact either way)
        inv_scale = self.grad_scale.double().reciprocal().float() if scaled else None
        # torch's fused AdamW and our Lamb read it (None: a step as usual). Set here, not in `update_masters`:
        # torch 2.11's dynamo cannot trace a setattr on the inner optimizer (COMPILE_OPTIMIZER=1)
        self.inner.found_inf = found_inf
        params = [p for p, _ in pairs]
        if self.layout:  # cast into the flat gradient's views here, outside COMPILE_OPTIMIZER's graph: there each
            # view's write became a temporary and a copy back into the buffer (module doc)
            torch._foreach_copy_(self.inner.grad_views, [p.grad for p in params])
        self.update_masters(params, [m for _, m in pairs], inv_scale, found_inf)

    def _update_masters(self, params: list[Tensor], masters: list[Tensor], inv_scale: Tensor | None,
                        found_inf: Tensor | None = None) -> None:
        """Steps 1-5 over the parameters that have a gradient: no host sync and no host value that changes
        between steps (the LR, the scale and the overflow flag are tensors), so COMPILE_OPTIMIZER=1 compiles it
        whole. With `found_inf` an overflowed step runs on zeroed gradients and the inner optimizer is told to
        change nothing (step 2 on the device); `step` has told the inner optimizer the same flag."""
        if self.layout:  # OPTIMIZER_LAYOUT=flat: the inner optimizer's flat gradient, which `step` has filled
            flat, grads = self.inner.grad, None
        elif inv_scale is None:  # bf16: a gradient per master, nothing to unscale or zero
            flat, grads = None, [torch.empty_like(m) for m in masters]
        else:  # fp16: views of one flat gradient, so that the unscale and the zeroing are one kernel each
            sizes = [m.numel() for m in masters]
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=masters[0].device)
            grads = [g.view_as(m) for g, m in zip(flat.split(sizes), masters)]
        if grads is not None:
            torch._foreach_copy_(grads, [p.grad for p in params])
        if inv_scale is not None:
            flat.mul_(inv_scale)
            if found_inf is not None:
                flat.masked_fill_(found_inf != 0, 0.0)  # inf x 0 would be NaN in the inner update's "x 0"
        if self.layout:  # the inner FlatLamb reads its one flat gradient: no per-tensor .grad (~400 host setattrs)
            # the clip's factor from the norm of the one buffer (its padding is zero), applied as the update reads it
            factor = None if self.clip_after is None else clip_factor(self.inner.grad, self.clip_after)
            self.inner.update(found_inf, factor)
            self.low.copy_(self.inner.weights)
            return
        for m, g in zip(masters, grads):
            m.grad = g
        if self.clip_after is not None:
            clip_after_allreduce(masters, self.clip_after)
        self.inner.step()
        for m in masters:
            m.grad = None
        torch._foreach_copy_(params, masters)

    @property
    def host_lr(self) -> bool:
        """Whether the inner optimizer takes its LR as a host float (apex's FusedLAMB, bert.optim.apex_lamb): the
        schedule then writes floats into these groups, which `step` copies into the inner ones."""
        return getattr(self.inner, "host_lr", False)

    @property
    def skips_on_device(self) -> bool:
        """Whether the inner optimizer leaves the masters and its state untouched, on the device, where told
        `found_inf`: our LAMB with its update count there, torch's fused AdamW. Not apex's FusedLAMB, nor the
        foreach AdamW a compiled step runs: for those the overflow is checked on the host."""
        inner = self.inner
        if isinstance(inner, Lamb):
            return inner.capturable
        return isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups)

    def state_dict(self) -> dict:
        """The inner optimizer's state (fp32, indexed as the plain optimizer's) with this one's hyperparameters."""
        inner = self.inner.state_dict()
        groups = [{**{k: v for k, v in outer.items() if k != "params"}, "params": g["params"]}
                  for outer, g in zip(self.param_groups, inner["param_groups"])]
        return {"state": inner["state"], "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)  # torch casts floating state to the masters' fp32
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})

    @contextmanager
    def masters_in_model(self) -> Iterator[None]:
        """Inside, each parameter's data is its fp32 master, so saving the model saves the masters and loading
        it writes them. On exit the parameters get their compute-dtype storage back, refreshed from the masters."""
        with torch.no_grad():
            try:
                with data_swapped(self.params, self.masters):
                    yield
            finally:
                torch._foreach_copy_(self.params, self.masters)


@contextmanager
def data_swapped(params: list[Tensor], tensors: list[Tensor]) -> Iterator[None]:
    """Inside, each parameter's data is the matching tensor; on exit its own storage is back."""
    own = [p.data for p in params]
    for p, t in zip(params, tensors, strict=True):
        p.data = t
    try:
        yield
    finally:
        for p, data in zip(params, own):
            p.data = data


def fp32_weights(optimizer: torch.optim.Optimizer | None) -> AbstractContextManager:
    """Where the model's fp32 weights are, for a checkpoint: the masters under MASTER_WEIGHTS=1, else the model.
    Every rank enters it: sharded masters (bert.optim.sharded_master) are all-gathered."""
    masters_in_model = getattr(optimizer, "masters_in_model", None)
    return masters_in_model() if masters_in_model else nullcontext()
