"""Sharded master weights: `OPTIMIZER_SHARDING=1` with `MASTER_WEIGHTS=1` and `OPTIMIZER_LAYOUT=flat`.

This is what the NVIDIA submissions run as DistributedFusedLAMB (`--distributed_lamb`, one block, [NVIDIA-BERT]) and
what the TPU paper calls weight-update sharding ([004] §3.2): every rank holds the whole model in the compute dtype,
and 1/N of the fp32 masters and of LAMB's moments. Per step:

  1. the model's gradients (DDP's buckets, reduced by nothing: `bert.optim.sharded.local_only`) are copied into one
     flat buffer of the compute dtype, laid out as `bert.optim.flat` lays out the masters (each tensor from a row of
     CHUNK elements), the rows padded to B blocks of N slices of k rows (B = OPTIMIZER_SHARD_BLOCKS);
  2. a reduce-scatter per block: rank r receives the sum of slice r of each, cast up to fp32, divided by N (fp16:
     divided before the sum, and unscaled);
  3. GRAD_CLIP=after: scaled as `clip_grad_norm_` would, by the global norm (one allreduce of the shards' squares);
  4. LAMB over the rank's rows (`bert.optim.flat.lamb_rows`, the unsharded flat update's code). A tensor cut by a
     shard boundary needs ||p|| and ||u|| whole: every rank sums its rows per tensor (float64) and one allreduce of
     those 2T partial sums (T tensors with weight decay) completes them;
  5. the rank's masters are rounded into its rows of the model's flat weight buffer, which is then all-gathered in
     place: every rank's model is whole again, in the same bits. Waited for here (gather="step"), or left in flight
     for the next forward to wait for block by block (gather="forward", bert.optim.gather_ahead).

Steps 2 and 5 are one reduce-scatter and one all-gather over every rank as written above (OPTIMIZER_SHARD_PLAN=flat,
the default); `bert.dist.shard_plan` also runs them node by node ([004] §3.3's two-dimensional summation, `2d`) or
as NVIDIA's DistributedFusedLAMB does, a copy of the masters per node (`node`): the plan says which slice a rank
owns and over which ranks a norm's partial sums add up; the rest of this module is the same for all three.

Traffic per rank per step (S parameters, 2-byte compute dtype, ring collectives, the flat plan): reduce-scatter
(N-1)/N * 2S and all-gather (N-1)/N * 2S, the bytes of DDP's allreduce of the bf16 gradients. What shrinks N-fold is
the update's work and its memory: the fp32 masters, moments and gradient, 16 bytes a parameter, become 16S/N
(BERT-large at 8 GPUs: 5.4 GB to 0.7 GB a rank). The compute-dtype gradient buffer of step 1 is kept (2 bytes a
parameter, beside DDP's buckets): its padding must stay zero.

When the reduce-scatters start. With one block (the default), in `step`, after the backward: NVIDIA's 1x8 and 8x8
configs run so (`--dwu-num-blocks=1`, no `--dwu-overlap-reductions`). With B > 1 (`attach`), a hook after each
parameter's gradient is accumulated copies it into step 1's buffer, and a block whose gradients are all there
starts its reduce-scatter at once, asynchronously, while the backward computes the rest ([NVIDIA-BERT]'s 434-node
config: `--dwu-num-blocks=5 --dwu-overlap-reductions`). The layout runs in the model's order and the backward in
the reverse, so the last blocks leave first; the layout puts the no-decay group (every layer's biases and
LayerNorms) before the decay group, beside the embeddings, so that only the first block waits for the end of the
backward (BERT-large, 5 blocks: blocks 4 to 1 start after 73, 135, 201 and 265 of its 302 gradients,
bench/shard_blocks.py); the step waits for the works. This needs the gradients final when accumulated: no clip in
DDP's hook (GRAD_CLIP=after or none), and nothing starts inside DDP's `no_sync` (micro-steps). Every rank starts the
blocks in one fixed order, the last first: NCCL pairs collectives by their order.

Exactness. The mean gradient is the sum of the ranks' compute-dtype gradients in the collective's order, divided in
fp32 (DDP under MASTER_WEIGHTS=1 sums the same values; with N a power of two the division is exact either way). The
update is the unsharded flat update's, op for op, but for the norms' sums (partial sums added across ranks): the
masters agree with `MasterWeights` over `FlatLamb` within fp32 rounding (tests/test_sharded_master.py).

Checkpoints are whole and in Lamb's per-tensor layout: `state_dict` all-gathers the moments (a collective), and
`masters_in_model` (every rank enters it: it all-gathers the masters) hands the checkpoint code fp32 weights to save
or load. A checkpoint therefore moves between world sizes and between sharded and unsharded runs.

fp16 (NVIDIA's A100 recipe, `--fp16 --distributed_lamb`): GradScaler hands the step its scale and overflow flag
(`_step_supports_amp_scaling`, as for `MasterWeights`). It finds the flag in the rank's own gradients, so ranks
could disagree on a skip and then on the scale; and a sum of finite fp16 gradients can overflow in the
reduce-scatter (they are divided by N before it, which rounds where N is not a power of two). So the step takes
the flag as the maximum, over the ranks (one allreduce on the device), of GradScaler's flag and of a non-finite
value in the rank's reduced shard, and writes it back where `AgreedGradScaler`'s `update` reads it. An overflowed
step is skipped on the device as `MasterWeights` skips it: the fp32 gradient zeroed, every moving factor of
`lamb_rows` 0. COMPILE_OPTIMIZER=1 is refused (the step runs collectives).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from bert.dist.clip import clip_shards_
from bert.dist.hierarchical import Pending
from bert.dist.shard_plan import FlatPlan, ShardPlan
from bert.optim.flat import CHUNK, FlatLayout, _Part, check_every_gradient, group_step, lamb_rows, tensor_sums64
from bert.optim.master import COMPUTE_DTYPES, data_swapped

Groups = list[dict]
SHARD_GATHERS = ("step", "forward")  # OPTIMIZER_SHARD_GATHER: where the updated weights' all-gather is waited for


def finish(works: dict[int, Pending], blocks: Iterable[int]) -> None:
    """Wait for the works of `blocks` (in that order) and forget them; a block with none is nothing to do."""
    for b in blocks:
        work = works.pop(b, None)
        if work is not None:
            work.wait()


def rows_below(x: int, starts: list[int], rows: int) -> int:
    """How many of a rank's layout rows (`rows` from each of `starts`) lie below layout row x: the shard row where
    layout row x would go (the slices follow each other in the shard as in the layout)."""
    return sum(min(max(x - s, 0), rows) for s in starts)


def shard_part(first: int, counts: list[int], below: Callable[[int], int], device: torch.device) -> _Part:
    """A group's share of one rank's rows: the group's tensors take `counts` layout rows each from row `first`, and
    `below(x)` is the shard row where layout row x would go. A tensor with no rows here has begin = end, so every
    rank's per-tensor sums have the same length. A tensor's rows here are contiguous in the shard: `below` is
    monotone, and its rows in two slices are the end of one and the start of the next."""
    at = [below(x) for x in itertools.accumulate(counts, initial=first)]
    owner = [i for i, (a, b) in enumerate(zip(at, at[1:])) for _ in range(b - a)]
    return _Part(at[0], at[-1], torch.tensor([a - at[0] for a in at[:-1]], device=device),
                 torch.tensor([b - at[0] for b in at[1:]], device=device),
                 torch.tensor(owner, dtype=torch.int64, device=device))


class AgreedGradScaler(torch.amp.GradScaler):
    """GradScaler that lets the sharded masters' step settle the overflow flag: it hands the step the flags it
    found in this rank's gradients (`scaler_flags`, the dict its `update` reads), and the step writes back the
    flag every rank agreed on, so every rank skips the same steps and keeps the same scale (module doc)."""

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict:
        found = super()._check_inf_per_device(optimizer)
        optimizer.scaler_flags = found
        return found


class ShardedMasters(torch.optim.Optimizer):
    """LAMB over this rank's rows of the fp32 masters, between a reduce-scatter and an all-gather (module doc).

    Its param_groups are the model's parameters, cast by the constructor to `compute_dtype` and made views of one
    flat buffer (`low`); the schedule writes the LR tensor into them and `step` reads it there."""

    _step_supports_amp_scaling = True  # fp16: GradScaler.step passes grad_scale / found_inf instead of unscaling

    def __init__(self, groups: Groups, compute_dtype: torch.dtype, lr: Tensor | float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, clip_after: float | None = None,
                 chunk: int = CHUNK, blocks: int = 1, plan: ShardPlan | None = None, gather: str = "step"):
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"sharded master weights need a bf16 or fp16 model, got {compute_dtype}")
        self.params: list[Tensor] = [p for g in groups for p in g["params"]]
        if not self.params or any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("sharded master weights are copied from fp32 parameters: build the optimizer before "
                             "the model is cast")
        if gather not in SHARD_GATHERS:
            raise ValueError(f"gather={gather!r} is not one of {', '.join(SHARD_GATHERS)}")
        self.clip_after, self.blocks, self.gather = clip_after, blocks, gather
        # who owns which slice, and the collectives that bring it there (OPTIMIZER_SHARD_PLAN; None: flat, every rank)
        self.plan = plan if plan is not None else FlatPlan()
        self.owners, self.owner, self.ranks = self.plan.owners, self.plan.owner, self.plan.ranks
        self.divide_first = compute_dtype == torch.float16  # fp16: the mean before the sum, which cannot overflow
        # The layout takes the groups last first: the no-decay group's biases and LayerNorms (every layer's, the
        # embeddings' included, whose gradients come last) join the embeddings in the first block (`attach`).
        sizes = list(itertools.accumulate((len(g["params"]) for g in groups), initial=0))
        self.order = [i for a, b in reversed(list(zip(sizes, sizes[1:]))) for i in range(a, b)]  # layout -> param
        self.layout = FlatLayout(tuple(self.params[i].numel() for i in self.order), chunk)
        at = {i: n for n, i in enumerate(self.order)}
        self.first_row = [self.layout.starts[at[i]] for i in range(len(self.params))]  # per parameter
        self.row_count = [self.layout.counts[at[i]] for i in range(len(self.params))]
        # B blocks of `owners` slices of k rows; this rank owns slice `owner` of each block, its shard is the B slices
        self.rows = -(-self.layout.rows // (self.owners * blocks))  # k
        self.block_rows = self.owners * self.rows
        self.starts = [b * self.block_rows + self.owner * self.rows for b in range(blocks)]
        device = self.params[0].device
        with torch.no_grad():
            whole = torch.zeros(blocks * self.block_rows * chunk, dtype=torch.float32, device=device)
            torch._foreach_copy_(self._views(whole), [p.detach() for p in self.params])
            self.masters = self._mine(whole).reshape(-1, chunk).clone()
            self.low = whole.to(compute_dtype)  # the model's weights: all-gathered into at every step
            del whole
            for p, view in zip(self.params, self._views(self.low)):
                p.data = view  # the same Parameter objects: groups, hooks and DDP keep them
        self.low_grad = torch.zeros_like(self.low)  # step 1's buffer; tensors' tails and the last rows stay zero
        self.low_grad_views = self._views(self.low_grad)
        self.grad_shard = self.low.new_zeros(self.masters.numel())  # the reduce-scatters' output
        # the plan's scratch between its two reduce-scatters (2d), a block's share each
        self.middle = self.low.new_zeros(blocks * self.plan.middle(self.block_rows * chunk))
        self.grad, self.exp_avg, self.exp_avg_sq = (torch.zeros_like(self.masters) for _ in range(3))
        self.parts: list[_Part | None] = []
        self.counters: list[Tensor] = []  # each group's update count (Lamb's capturable `step`)
        below = functools.partial(rows_below, starts=self.starts, rows=self.rows)
        for a, b in zip(sizes, sizes[1:]):  # a group's tensors are consecutive in the layout, in their order
            self.parts.append(shard_part(self.first_row[a], self.row_count[a:b], below, device) if b > a else None)
            self.counters.append(torch.zeros((), dtype=torch.float32, device=device))
        # each tensor's blocks; a block of padding alone (few rows, many ranks) is never reduced: its zeros stay
        self.blocks_of = [range(a // self.block_rows, (a + n - 1) // self.block_rows + 1)
                          for a, n in zip(self.first_row, self.row_count)]
        self.waiting = [sum(b in bs for bs in self.blocks_of) for b in range(blocks)]
        self.filled = [b for b in range(blocks) if self.waiting[b]]
        self.works: dict[int, Pending] = {}  # the reduce-scatters the backward started (`attach`)
        self.gathers: dict[int, Pending] = {}  # the all-gathers `step` left to the next forward (gather="forward")
        self.stepped = False  # Lamb has no state before its first step; nor does this
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    def _views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of a flat buffer of the layout, in the parameters' order."""
        views = self.layout.views(flat, [self.params[i].shape for i in self.order])
        return [views[n] for n in sorted(range(len(self.order)), key=self.order.__getitem__)]

    def _mine(self, flat: Tensor) -> Tensor:
        """This rank's slices of a flat buffer of the layout, as a [B, k, chunk] view."""
        return flat.view(self.blocks, self.owners, self.rows, self.layout.chunk)[:, self.owner]

    def _block(self, flat: Tensor, b: int) -> Tensor:
        n = self.block_rows * self.layout.chunk
        return flat[b * n:(b + 1) * n]

    def _reduce_block(self, b: int, async_op: bool = False) -> Pending | None:
        """Block b's mean-to-be into this rank's slice of `grad_shard` (fp16: divided first)."""
        block = self._block(self.low_grad, b)
        if self.divide_first:
            block.div_(self.ranks)
        n, m = self.rows * self.layout.chunk, self.middle.numel() // self.blocks
        return self.plan.reduce_scatter(self.grad_shard[b * n:(b + 1) * n], block, self.middle[b * m:(b + 1) * m],
                                        async_op=async_op)

    # -- reduce-scatters started from the backward (OPTIMIZER_SHARD_BLOCKS > 1)
    def attach(self, ddp: torch.nn.Module) -> None:
        """With more than one block, start each block's reduce-scatter from the backward, once every gradient in it
        is there (a hook after each parameter's gradient is accumulated), so the blocks finished early travel while
        the backward computes the rest; `step` waits for them. Nothing starts in DDP's `no_sync` (micro-steps), and
        a backward there drops what an earlier one started (a backward outside DDP, as the compile warm-up's on the
        bare module, starts them: the next backward finishes and replaces them). Only where the gradients are final
        when accumulated: no clipping in DDP's hook."""
        if self.blocks == 1:
            return
        self.ddp = ddp
        self.left = list(self.waiting)
        # Started last block first, whatever order the gradients complete them in on a rank: every rank then issues
        # the same collectives in the same order (NCCL pairs them by order; blocks of one size would not even fail).
        # The backward runs the model from its end, so this is the order they complete in anyway.
        self.launch_order, self.launched, self.complete = self.filled[::-1], 0, set()
        self.in_backward = False  # set by a backward's first gradient, cleared when the engine has run it all
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))

    def _drop_stale(self, blocks: Iterable[int]) -> None:
        """Finish and forget the reduce-scatters of a backward no step took."""
        finish(self.works, blocks)

    @torch.no_grad()
    def _ready(self, i: int, p: Tensor) -> None:
        if not self.ddp.require_backward_grad_sync:  # a micro-step: the step will not take what came before
            self._drop_stale(list(self.works))
            return
        if not self.in_backward:  # the first gradient of a backward: its end is marked when the engine is done
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            # what a backward before this one started and no step took is finished all at once, in the order it
            # started (the same on every rank, as NCCL needs), before the copies below overwrite what it reads; and
            # the counts start afresh, also after a backward that ended before all its blocks were in
            self._drop_stale(list(self.works))
            self.left, self.launched, self.complete = list(self.waiting), 0, set()
        self.low_grad_views[i].copy_(p.grad)
        for b in self.blocks_of[i]:
            self.left[b] -= 1
            if self.left[b] == 0:
                self.left[b] = self.waiting[b]
                self.complete.add(b)
        order = self.launch_order
        while self.launched < len(order) and order[self.launched] in self.complete:
            self.complete.discard(order[self.launched])
            self.works[order[self.launched]] = self._reduce_block(order[self.launched], async_op=True)
            self.launched += 1
        if self.launched == len(order):  # every block started: the next backward begins with the last again
            self.launched = 0

    def _backward_done(self) -> None:
        self.in_backward = False

    def _agree(self, found_inf: Tensor) -> Tensor:
        """fp16: the overflow flag of every rank's gradients and reduced shard, written back for GradScaler's
        `update` (AgreedGradScaler), so the scale stays the same on every rank."""
        flags = getattr(self, "scaler_flags", None)
        if flags is None:
            raise ValueError("the sharded masters under fp16 need AgreedGradScaler (bert.train.build.build_scaler)")
        flag = torch.maximum(found_inf, (~self.grad.isfinite()).any().float()).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.plan.flag_group)
        for mine in flags.values():
            mine.copy_(flag.reshape(mine.shape))
        return flag.reshape(found_inf.shape)

    def _shard(self, flat: Tensor, part: _Part) -> Tensor:
        return flat[part.first:part.last]

    def _norms(self, p_squares: Tensor, u_squares: Tensor, part: _Part) -> tuple[Tensor, Tensor]:
        """Whole tensors' (||p||, ||u||) from every rank's rows: one allreduce of the partial sums."""
        partial = torch.cat([tensor_sums64(p_squares, part), tensor_sums64(u_squares, part)])
        dist.all_reduce(partial, group=self.plan.norm_group)
        norms = partial.float().sqrt()
        return norms[:len(part.ends)], norms[len(part.ends):]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("ShardedMasters.step does not take a closure")
        found_inf = getattr(self, "found_inf", None)  # fp16 only: set by AgreedGradScaler.step, every rank's
        if not check_every_gradient(self.params, "the sharded masters (OPTIMIZER_SHARDING=1) need them all"):
            return
        self.wait_gathered()  # a forward waits for them all; without one (two steps in a row), here
        started = [self.works.pop(b, None) for b in self.filled]
        if all(w is not None for w in started):  # from the backward (`attach`)
            for work in started:
                work.wait()
        elif any(w is not None for w in started):
            raise RuntimeError("OPTIMIZER_SHARD_BLOCKS: the backward started the reduce-scatter of some blocks only")
        else:
            torch._foreach_copy_(self.low_grad_views, [p.grad for p in self.params])
            for b in self.filled:
                self._reduce_block(b)
        self.grad.view(-1).copy_(self.grad_shard)
        if found_inf is not None:
            found_inf = self._agree(found_inf)
        if not self.divide_first:
            self.grad.div_(self.ranks)  # bf16: divided in fp32, after an exact-range sum
        else:  # as GradScaler.unscale_: 1 / scale in float64, then fp32; an overflowed step's gradient zeroed
            self.grad.mul_(self.grad_scale.double().reciprocal().float())
            self.grad.masked_fill_(found_inf != 0, 0.0)
        if self.clip_after is not None:  # on the mean gradient, from the shards (their padding is zero)
            clip_shards_(self.grad, self.clip_after, self.plan.norm_group)
        for group, part, t in zip(self.param_groups, self.parts, self.counters):
            if part is not None:
                p, g, m, v = (self._shard(b, part) for b in (self.masters, self.grad, self.exp_avg, self.exp_avg_sq))
                lamb_rows(p, g, m, v, group_step(group, t, found_inf), part, self._norms)
        self.stepped = True
        self._mine(self.low).copy_(self.masters.view(self.blocks, self.rows, -1))
        # In place, this rank's slice of each block the input; in the model's order, as the next forward reads them.
        # "forward": left in flight, each waited for by the first module of the next forward that reads its block.
        ahead = self.gather == "forward"
        for b in range(self.blocks):
            work = self.plan.all_gather(self._block(self.low, b), async_op=ahead)
            if ahead:
                self.gathers[b] = work

    def wait_gathered(self, blocks: Iterable[int] | None = None) -> None:
        """Wait for the all-gathers of `blocks` (None: every block) that `step` left in flight (gather="forward"):
        on a GPU the caller's stream waits, on the CPU (gloo) the host."""
        finish(self.gathers, sorted(self.gathers) if blocks is None else blocks)

    # -- whole checkpoints
    def _gathered(self, shard: Tensor) -> list[Tensor]:
        """Every tensor's whole values of a [K, chunk] shard buffer, as views of one gathered buffer."""
        whole = shard.new_empty(self.low.numel())
        self._mine(whole).copy_(shard.view(self.blocks, self.rows, -1))
        for b in range(self.blocks):
            self.plan.all_gather(self._block(whole, b))
        return self._views(whole)

    def state_dict(self) -> dict:
        """Lamb's state_dict (full-shape moments on the host, one update count per group): a collective."""
        groups = super().state_dict()["param_groups"]
        state: dict[int, dict] = {}
        if self.stepped:
            for group, t in zip(groups, self.counters):
                state.update({i: {"step": t.clone()} for i in group["params"]})
            for key, shard in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                # one whole buffer on the device at a time (1.3 GB for BERT-large), into host memory at once
                for i, whole in enumerate(self._gathered(shard)):
                    state[i][key] = whole.to("cpu", copy=True)
        return {"state": state, "param_groups": groups}

    def _take_rows(self, shard: Tensor, i: int, whole: Tensor) -> None:
        """Write this rank's part of tensor i (`whole`, any shape) into a [B k, chunk] shard buffer."""
        chunk, flat = self.layout.chunk, shard.view(-1)
        start, n = self.first_row[i] * chunk, self.params[i].numel()
        for b, s in enumerate(self.starts):  # slice b: layout elements from s * chunk, shard elements from b k chunk
            a, e = max(start, s * chunk), min(start + n, (s + self.rows) * chunk)
            if e > a:
                at = b * self.rows * chunk - s * chunk
                flat[a + at:e + at] = whole.reshape(-1)[a - start:e - start]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (Lamb's layout, from any world size or layout): keep this rank's rows."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = state_dict["state"]
        with torch.no_grad():
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            for group, t in zip(state_dict["param_groups"], self.counters):
                t.zero_()  # a group without saved state starts afresh, as Lamb's
                for i in group["params"]:
                    if i in saved:
                        self._take_rows(self.exp_avg, i, saved[i]["exp_avg"])
                        self._take_rows(self.exp_avg_sq, i, saved[i]["exp_avg_sq"])
                        t.copy_(torch.as_tensor(saved[i]["step"], dtype=torch.float32))
        self.stepped = bool(saved)

    @contextmanager
    def masters_in_model(self) -> Iterator[None]:
        """Inside, each parameter's data is its whole fp32 master (all-gathered: every rank must enter), so saving
        the model saves the masters and loading it writes them. On exit each rank keeps its rows as its masters and
        the model's weights are refreshed from them."""
        self.wait_gathered()  # the model's weights are written below
        whole = self._gathered(self.masters)
        with torch.no_grad():
            try:
                with data_swapped(self.params, whole):
                    yield
            finally:
                for i, w in enumerate(whole):
                    self._take_rows(self.masters, i, w)
                torch._foreach_copy_(self.params, whole)
