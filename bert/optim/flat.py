"""`OPTIMIZER_LAYOUT=flat`: LAMB over flat buffers, every tensor starting on a row of CHUNK elements.

The foreach LAMB (bert.optim.lamb) makes each pass over BERT-large's ~400 tensors, from 1,024 to 31 M
elements. Compiled (COMPILE_OPTIMIZER=1), that update took 7.6 ms of the H200's 122 ms step for about 13 GB of
memory traffic, which the card moves in under 3 ms. Here the fp32 masters, the moments m and v and the fp32
gradients are each one buffer of shape [rows, CHUNK], each tensor padded with zeros to whole rows, so a step is

    pass 1, over the rows   m and v updated, u formed, and each row's sums of p^2 and u^2
    per tensor              its rows' sums added (a float64 running sum: a fixed order), trust r = ||p|| / ||u||
    pass 2, pointwise       p = p - lr r u, r gathered by the row's tensor

plus the gradients' cast up and the weights' copy back, one flat pass each (bert.optim.master). The padding
stays zero: g = 0 there, so m = v = 0, u = 0 / (0 + eps) + wd 0 = 0, and p does not move.

The passes cover every param group's rows at once: a tensor's LR and trust ratio come from its group, a row's
bias corrections and weight decay from its tensor's (`RowStep`), so the groups must share betas and eps and decay
by one weight decay or none (decay_groups' two do). One pass, not one per group: compiled for an H100
(bench/gpu_compile.py on the fake GPU), a group's in-place update of its slice of the buffers became new buffers
and copies back into them, and the step moved 31.6 GB in 13 kernels; over whole buffers it moves 14.1 GB in 7
(BERT-large). The `after` clip's factor is applied as the gradient is read (`grad_factor`), not in a pass of
its own that writes the gradient back.

The arithmetic per element is Lamb's, op for op (bias corrections, lerp, addcmul, sqrt, the found_inf skip);
only the norms sum in another order, so the weights agree with Lamb's within fp32 rounding, not bit for bit
(tests/test_flat_lamb.py).

Checkpoints: the state is laid out per tensor as Lamb's (`exp_avg` and `exp_avg_sq` are views of the flat
moments, `step` one device counter per group), so a checkpoint moves between the layouts; loading copies the
values into the flat buffers.

Built inside MasterWeights (the config refuses OPTIMIZER_LAYOUT=flat without MASTER_WEIGHTS=1 and LAMB): the
masters become views of `weights`, MasterWeights casts the model's gradients straight into `grad_views`
(`grads_in_place`; used alone, `step` copies each `.grad` there first), and the model's low-precision weights are
views of one buffer of the same layout. Every tensor must have a gradient at every step: one without would still
move by its weight decay and its moments. Memory: the fp32 gradient buffer is kept between steps (4 bytes a
parameter, 1.35 GB for BERT-large), where the per-tensor update makes its fp32 gradients during the step only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from bert.optim.lamb import Lamb, _bias_corrections

CHUNK = 2048  # a row: whole rows keep tensors apart; 1,024-element biases waste half a row each (0.1 % in all)
LAYOUTS = ("tensors", "flat")  # OPTIMIZER_LAYOUT's choices


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a list lives in a flat buffer of `rows` x `chunk` elements: from row `starts[i]`,
    over `counts[i]` rows, its elements first and zeros after."""

    numels: tuple[int, ...]
    chunk: int = CHUNK

    @property
    def counts(self) -> list[int]:
        return [-(-n // self.chunk) for n in self.numels]

    @property
    def starts(self) -> list[int]:
        starts, row = [], 0
        for count in self.counts:
            starts.append(row)
            row += count
        return starts

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def buffer(self, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A zero buffer of this layout, flat, on `like`'s device."""
        return torch.zeros(self.rows * self.chunk, dtype=dtype or like.dtype, device=like.device)

    def views(self, flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
        """Each tensor's view of `flat` (a buffer of this layout), with its shape."""
        return [flat[start * self.chunk:start * self.chunk + n].view(shape)
                for start, n, shape in zip(self.starts, self.numels, shapes, strict=True)]


def move_into(tensors: Sequence[Tensor], layout: FlatLayout, dtype: torch.dtype) -> Tensor:
    """A buffer of `layout` in `dtype` holding `tensors` (cast), each of which becomes a view of it, in place
    (`.data`: the same tensor objects, so optimizer groups, modules and hooks keep them). Returns the buffer."""
    flat = layout.buffer(tensors[0], dtype)
    with torch.no_grad():
        for t, view in zip(tensors, layout.views(flat, [t.shape for t in tensors]), strict=True):
            view.copy_(t)
            t.data = view
    return flat


def check_every_gradient(params: Sequence[Tensor], remedy: str = "use OPTIMIZER_LAYOUT=tensors") -> bool:
    """Whether the step has gradients to apply: all of them (True) or none (False); a few missing is an error."""
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing and len(missing) < len(params):
        raise ValueError(f"OPTIMIZER_LAYOUT=flat updates every tensor at once, but tensor {missing[0]} of "
                         f"{len(params)} has no gradient this step (it would move by its weight decay): {remedy}")
    return not missing


@dataclass(frozen=True)
class _Part:
    """A block of the buffers' rows, [first, last) (FlatLamb's: every row; the sharded masters': a group's share of a
    rank's rows); per tensor of the block, where its rows begin and end (relative to `first`); per row, the tensor
    (its index in the block) it holds."""

    first: int
    last: int
    begins: Tensor
    ends: Tensor
    owner: Tensor


def tensor_sums64(row_sums: Tensor, part: _Part) -> Tensor:
    """Each tensor's sum of its rows' sums, in float64: differences of a float64 running sum, in a fixed order (no
    atomics) and in ops inductor generates itself. Each difference is exact to ~1e-16 of the running total:
    BERT-large's weights sum to ~1e5 squared, its smallest decayed tensor (token types) to ~1, so ~1e-11 of it, far
    below fp32's rounding."""
    running = torch.nn.functional.pad(row_sums.double().cumsum(0), (1, 0))
    return running[part.ends] - running[part.begins]


def tensor_sums(row_sums: Tensor, part: _Part) -> Tensor:
    return tensor_sums64(row_sums, part).float()


def local_norms(p_squares: Tensor, u_squares: Tensor, part: _Part) -> tuple[Tensor, Tensor]:
    """(||p||, ||u||) per tensor from the rows' sums of squares, where every row of each tensor is here."""
    return tensor_sums(p_squares, part).sqrt(), tensor_sums(u_squares, part).sqrt()


RowNorms = Callable[[Tensor, Tensor, _Part], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class RowStep:
    """One update's settings for a block of rows: the betas and eps, shared; the LR and whether the trust ratio
    applies (a weight decay that is not 0), each one for the block or per tensor ([k]); the weight decay, one
    float, applied to the rows `decayed_rows` marks ([rows, 1] bool; None: every row); the bias corrections, one
    for the block or per row ([rows, 1]); `take`, found_inf == 0 (None: no fp16 skip)."""

    b1: float
    b2: float
    eps: float
    lr: Tensor
    trusted: Tensor | bool
    weight_decay: float
    decayed_rows: Tensor | None
    c1: Tensor
    sqrt_c2: Tensor
    take: Tensor | None


def count_step(t: Tensor, found_inf: Tensor | None) -> Tensor:
    """Advance a group's update count `t` in place (not on an overflowed step); the count its bias corrections use."""
    if found_inf is None:
        return t.add_(1)
    t.add_((found_inf == 0).float())
    return t.clamp(min=1)  # a first step skipped leaves t = 0; m = v = 0 then, and the update is 0


def group_step(group: dict, t: Tensor, found_inf: Tensor | None) -> RowStep:
    """A param group's RowStep, its count `t` advanced: every setting one for its rows."""
    b1, b2 = group["betas"]
    c1, sqrt_c2 = _bias_corrections(b1, b2, count_step(t, found_inf))
    take = None if found_inf is None else found_inf == 0
    lr = torch.as_tensor(group["lr"], device=t.device)
    return RowStep(b1, b2, group["eps"], lr if take is None else lr * take, group["weight_decay"] != 0.0,
                   group["weight_decay"], None, c1, sqrt_c2, take)


def lamb_rows(p: Tensor, g: Tensor, m: Tensor, v: Tensor, s: RowStep, part: _Part,
              norms: RowNorms = local_norms, grad_factor: Tensor | None = None) -> None:
    """One LAMB update, in place, of a block of rows ([rows, chunk] views of the weights, gradients and moments)
    with the settings `s`; `norms` completes each tensor's norms from these rows' sums of squares (the sharded
    masters add other ranks' rows: bert.optim.sharded_master). `grad_factor` (the `after` clip's) multiplies the
    gradient: compiled, as it is read, so the buffer is neither written nor read again; eager, in place."""
    if grad_factor is not None:
        g = g * grad_factor if torch.compiler.is_compiling() else g.mul_(grad_factor)
    if s.take is None:
        m.lerp_(g, 1.0 - s.b1)
        v.mul_(s.b2)
    else:  # Lamb's skip without a host sync: every factor that moves a value is 0 where found_inf is 1
        m.lerp_(g, torch.where(s.take, 1.0 - s.b1, 0.0))
        v.mul_(torch.where(s.take, s.b2, 1.0))
    v.addcmul_(g, g, value=1.0 - s.b2)
    update = m / (v.sqrt() / s.sqrt_c2 + s.eps) / s.c1
    if s.trusted is False:  # no weight decay anywhere: Lamb applies no trust ratio
        p.add_(update * (-s.lr if s.lr.dim() == 0 else -s.lr[part.owner][:, None]))
        return
    decayed = update.add(p, alpha=s.weight_decay)
    update = decayed if s.decayed_rows is None else torch.where(s.decayed_rows, decayed, update)
    p_norm, u_norm = norms(p.square().sum(1), update.square().sum(1), part)
    trust = torch.where(s.trusted & (p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
    p.add_(update * (-s.lr * trust)[part.owner][:, None])


class FlatLamb(Lamb):
    """LAMB as `Lamb(capturable=True)` computes it, over fp32 tensors it moves into flat buffers (module doc)."""

    def __init__(self, params, lr: Tensor | float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, chunk: int = CHUNK):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        tensors = [p for g in self.param_groups for p in g["params"]]
        if not tensors or any(t.dtype != torch.float32 for t in tensors):
            raise ValueError("OPTIMIZER_LAYOUT=flat updates fp32 tensors (MasterWeights' masters)")
        self.layout = FlatLayout(tuple(t.numel() for t in tensors), chunk)
        self.weights = move_into(tensors, self.layout, torch.float32)
        self.exp_avg, self.exp_avg_sq, self.grad = (self.layout.buffer(self.weights) for _ in range(3))
        shapes = [t.shape for t in tensors]
        self.grad_views = self.layout.views(self.grad, shapes)  # what MasterWeights casts the gradients into
        self._moments = dict(zip(tensors, zip(self.layout.views(self.exp_avg, shapes),
                                              self.layout.views(self.exp_avg_sq, shapes))))
        # False: `step` first copies each tensor's .grad into `grad_views`; MasterWeights writes them there itself
        self.grads_in_place = False
        self._one_pass_settings()

    def _one_pass_settings(self) -> None:
        """What one pass over every row needs (module doc): each tensor's rows and group, and which rows decay.
        The groups must share betas and eps, and decay by one weight decay or none (decay_groups' two groups do)."""
        groups = [g for g in self.param_groups if g["params"]]
        if len({(tuple(g["betas"]), g["eps"]) for g in groups}) > 1 or \
                len({g["weight_decay"] for g in groups} - {0.0}) > 1:
            raise ValueError("OPTIMIZER_LAYOUT=flat updates every group in one pass: the groups must share betas "
                             "and eps, and have one weight decay or none")
        device, counts = self.weights.device, self.layout.counts
        ends = list(itertools.accumulate(counts))
        owner = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                        torch.tensor(counts, dtype=torch.int64, device=device),
                                        output_size=ends[-1])  # known here: no host read of the rows back
        self.whole = _Part(0, ends[-1], torch.tensor([0, *ends[:-1]], device=device), torch.tensor(ends, device=device),
                           owner)
        # per tensor: its group (among the groups with tensors) and whether its trust ratio applies
        group_of = [i for i, g in enumerate(groups) for _ in g["params"]]
        self.tensor_group = torch.tensor(group_of, device=device)
        decays = [g["weight_decay"] != 0.0 for g in groups]
        self.trusted: Tensor | bool = decays[0] if len(set(decays)) == 1 else \
            torch.tensor([decays[i] for i in group_of], device=device)
        self.row_group = self.tensor_group[owner]
        self.decayed_rows = self.trusted[owner][:, None] if torch.is_tensor(self.trusted) else None
        self.weight_decay = max(g["weight_decay"] for g in groups)
        self._settings = self._group_settings()

    def _group_settings(self) -> list[tuple]:
        return [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in self.param_groups if g["params"]]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("FlatLamb.step does not take a closure")
        if not self.grads_in_place:  # in place, MasterWeights has checked the model's gradients and cast them in
            params = [p for g in self.param_groups for p in g["params"]]
            if not check_every_gradient(params):
                return
            torch._foreach_copy_(self.grad_views, [p.grad for p in params])
        self.update(getattr(self, "found_inf", None))  # set under fp16 by bert.optim.master (bert.optim.lamb's doc)

    def update(self, found_inf: Tensor | None = None, grad_factor: Tensor | None = None) -> None:
        """Every group's rows in one pass (module doc), from the flat gradient times `grad_factor` (MasterWeights'
        `after` clip, folded in). One pass, not one per group: compiled, an in-place update of a slice of a buffer
        became a new buffer and a copy back into it, about twice the memory traffic of the update itself."""
        if self._group_settings() != self._settings:  # a group's betas, eps or weight decay changed since
            self._one_pass_settings()
        groups = [g for g in self.param_groups if g["params"]]
        b1, b2 = groups[0]["betas"]
        counts = torch.stack([count_step(self._counter(g), found_inf) for g in groups])
        c1, sqrt_c2 = _bias_corrections(b1, b2, counts)
        lr = torch.stack([torch.as_tensor(g["lr"], dtype=torch.float32, device=self.weights.device) for g in groups])
        take = None if found_inf is None else found_inf == 0
        step = RowStep(b1, b2, groups[0]["eps"], (lr if take is None else lr * take)[self.tensor_group],
                       self.trusted, self.weight_decay, self.decayed_rows, c1[self.row_group][:, None],
                       sqrt_c2[self.row_group][:, None], take)
        p, g, m, v = (flat.view(-1, self.layout.chunk) for flat in (self.weights, self.grad, self.exp_avg,
                                                                    self.exp_avg_sq))
        lamb_rows(p, g, m, v, step, self.whole, grad_factor=grad_factor)

    def _counter(self, group: dict) -> Tensor:
        """The group's update count, one fp32 device tensor shared by its tensors' states (Lamb's layout), which
        are made on the first step: the moments as views of the flat buffers."""
        params = group["params"]
        if not self.state[params[0]]:
            t = torch.zeros((), dtype=torch.float32, device=self.weights.device)
            for p in params:
                m, v = self._moments[p]
                self.state[p].update(step=t, exp_avg=m, exp_avg_sq=v)
        return self.state[params[0]]["step"]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (per tensor, as Lamb's), then the moments copied into the flat buffers and the states
        pointed back at their views; a tensor without saved state starts from zero moments, as in Lamb."""
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for group in self.param_groups:
                saved = [p for p in group["params"] if self.state[p]]
                for p in group["params"]:  # tensor by tensor: a state_dict of this optimizer holds our own views
                    for view, key in zip(self._moments[p], ("exp_avg", "exp_avg_sq")):
                        if self.state[p]:
                            view.copy_(self.state[p][key])
                        else:
                            view.zero_()
                if saved:
                    t = torch.as_tensor(self.state[saved[0]]["step"], dtype=torch.float32,
                                        device=self.weights.device).clone()
                    for p in group["params"]:
                        m, v = self._moments[p]
                        self.state[p].update(step=t, exp_avg=m, exp_avg_sq=v)
