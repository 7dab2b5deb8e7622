"""Weight-update sharding (TPU [004] §3.2, after Xu et al.; NVIDIA's DistributedFusedLAMB does the same).

With plain data parallelism every rank runs the whole LAMB/AdamW update and keeps the whole optimizer
state. Sharded (`OPTIMIZER_SHARDING=1`), each step of `ShardedOptimizer.step` is:

  1. reduce-scatter the flat gradient: rank r receives the world mean of its 1/N of it;
  2. rank r runs the same optimizer math (LAMB or fused AdamW) on that shard only, so it holds the
     optimizer state (exp_avg, exp_avg_sq) of 1/N of the weights;
  3. all-gather the updated weights, so every replica holds the whole model again.

Layout: the trainable parameters, in the optimizer's group order, are concatenated into one flat
vector of S elements, padded to N*L (L = ceil(S/N)); rank r owns [rL, (r+1)L). A tensor may span
shards. The inner optimizer gets one *piece* per tensor (a view of the rank's part of the parameter,
empty where it owns none), so its groups, indices and state keys are the unsharded optimizer's.

Exactness. AdamW is elementwise: the update is the unsharded one on every element. LAMB's trust
ratio ||p|| / ||u|| is per tensor: each rank takes the squared norms of its pieces and one allreduce
of that small vector (2 x tensors with weight decay, float64) per step completes them; the result
differs from the unsharded norms by float rounding only (a sum of partial sums). The whole update
is equal to the unsharded one up to round-off, not bit for bit: a ring collective's order of
addition for an element depends on where the element lies in the buffer, and DDP's buckets and this
flat buffer place it differently (tests/test_optim_sharding.py: <= 5e-15 relative in float64).

Memory per rank: optimizer state 2S/N (fp32) instead of 2S, plus the kept shard (S/N); the flat
N*L buffer is allocated inside `step` only. LAMB on a shard always uses the foreach `Lamb`.

Clipping keeps its meaning. DDP's hook no longer averages anything (`local_only`): the reduce-scatter
here is the one reduction. `before` and `bucket` clip the local gradient inside the hook as before
(they never needed the average). `after` needs the averaged gradient, which only exists here as
shards, so it is done in step 2: global norm = sqrt(allreduce of the shards' squared norms), then
the shard is scaled exactly as `clip_grad_norm_` would (max_norm / (norm + 1e-6), at most 1).
`bert.optim.hook_clip_mode` tells the builder which mode the hook runs.

fp16: the GradScaler unscales and checks the *local* gradients before `step`; a rank's inf would
then skip the step on that rank alone. `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` allreduces the
inf flag, so every rank skips together (bert.train.build uses it under sharding).

What travels per step, S fp32 gradients/weights, N ranks, ring collectives, bytes per rank:
    unsharded   allreduce of the gradients                 2 (N-1)/N * 4S
    sharded     reduce-scatter of the gradients             (N-1)/N * 4S
                all-gather of the updated weights          (N-1)/N * 4S
                LAMB norms: allreduce of 2T float64        (T tensors with weight decay; 3 kB for BERT-large)
The bulk is the same; what changes is that the gradient reduction starts after the backward pass
instead of overlapping it bucket by bucket, and that the update and its state shrink by N.

Checkpoints are whole: `state_dict()` all-gathers the state into the unsharded optimizer's layout
(same indices, full-shape tensors), so a checkpoint resumes at any world size, sharded or not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from bert.config import OptimConfig
from bert.dist.clip import clip_shards_
from bert.dist.flat_collectives import all_gather_single, reduce_scatter_single
from bert.optim.lamb import Lamb

Groups = list[dict]
InnerBuilder = Callable[[Groups, "ShardedOptimizer"], torch.optim.Optimizer]


def local_only() -> Callable[[Tensor], Future[Tensor]]:
    """The `Reduce` for DDP's hook under sharding: nothing travels; the optimizer reduce-scatters."""

    def reduce(flat: Tensor) -> Future[Tensor]:
        done: Future[Tensor] = Future()
        done.set_result(flat)
        return done

    return reduce


class ShardedOptimizer(torch.optim.Optimizer):
    """Runs `inner` (built over this rank's pieces) between a reduce-scatter and an all-gather.

    Its own param_groups are the model's parameters, with the hyperparameters (the schedule's LR
    tensor included) copied into the inner groups at every step: the GradScaler, `zero_grad` and
    the schedule see an ordinary optimizer.
    """

    def __init__(self, groups: Groups, build_inner: InnerBuilder, clip_after: float | None = None,
                 process_group: dist.ProcessGroup | None = None):
        self.process_group, self.clip_after = process_group, clip_after
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.params = [p for g in groups for p in g["params"]]
        first = self.params[0]
        if any(p.dtype != first.dtype or p.device != first.device or not p.is_contiguous() for p in self.params):
            raise ValueError("optimizer sharding needs contiguous parameters of one dtype on one device")
        self.sizes = [p.numel() for p in self.params]
        self.total = sum(self.sizes)
        self.shard_len = -(-self.total // self.world)
        lo, hi = self.rank * self.shard_len, min((self.rank + 1) * self.shard_len, self.total)
        # The shard is kept (the pieces' .grad are views of it); the flat N*L buffer lives only inside a step,
        # so on a GPU its memory is reused by the activations of the next forward pass.
        self.shard = torch.zeros(self.shard_len, dtype=first.dtype, device=first.device)  # grads in, weights out
        self.spans: list[tuple[int, int]] = []  # this rank's [a, b) inside each tensor
        pieces, start = [], 0
        for p, n in zip(self.params, self.sizes):
            a, b = min(max(lo - start, 0), n), min(max(hi - start, 0), n)
            piece = p.detach().view(-1)[a:b]  # shares the parameter's storage: the update lands in place
            piece.grad = self.shard[start + a - lo:start + b - lo] if b > a else self.shard[:0]
            self.spans.append((a, b))
            pieces.append(piece)
            start += n
        self.pieces, self.owned = pieces, hi - lo if hi > lo else 0
        piece_groups, i = [], 0
        for g in groups:
            k = len(g["params"])
            piece_groups.append({**g, "params": pieces[i:i + k]})
            i += k
        self.inner = build_inner(piece_groups, self)
        super().__init__(groups, self.inner.defaults)

    # -- collectives
    def tensor_norms(self, params: list[Tensor], update: list[Tensor]) -> tuple[Tensor, Tensor]:
        """LAMB's per-tensor norms of whole tensors from every rank's pieces: one allreduce."""
        partial = torch.stack([*torch._foreach_norm(params), *torch._foreach_norm(update)]).double()
        squares = partial.square()
        dist.all_reduce(squares, group=self.process_group)
        norms = squares.sqrt().to(params[0].dtype)
        return norms[:len(params)], norms[len(params):]

    def _flat(self) -> Tensor:
        return self.shard.new_zeros(self.world * self.shard_len)

    def _reduce_scatter_mean(self, flat: Tensor) -> None:
        if any(p.grad is None for p in self.params):
            raise RuntimeError("sharded update: a parameter has no gradient (every rank must send every one)")
        torch.cat([p.grad.reshape(-1) for p in self.params], out=flat[:self.total])
        flat.div_(self.world)  # as DDP's allreduce: divide, then sum
        reduce_scatter_single(self.shard, flat, group=self.process_group)

    def _all_gather_weights(self, flat: Tensor) -> None:
        own = [piece for piece in self.pieces if piece.numel()]
        if own:
            torch.cat(own, out=self.shard[:self.owned])
        all_gather_single(flat, self.shard, group=self.process_group)
        whole = [t.view_as(p) for t, p in zip(flat[:self.total].split(self.sizes), self.params)]
        torch._foreach_copy_(self.params, whole)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        flat = self._flat()
        self._reduce_scatter_mean(flat)
        if self.clip_after is not None:  # on the averaged gradient, from the shards
            clip_shards_(self.shard[:self.owned], self.clip_after, self.process_group)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.inner.step()
        self._all_gather_weights(flat)

    # -- whole checkpoints
    @staticmethod
    def _per_element(value: object, shape: torch.Size) -> bool:
        """A state entry with one value per parameter element (exp_avg, exp_avg_sq), not a step count."""
        return torch.is_tensor(value) and value.dim() > 0 and value.shape == shape

    def state_dict(self) -> dict:
        """The unsharded optimizer's state_dict: same indices, full-shape tensors on the host (a collective)."""
        inner = self.inner.state_dict()
        state = {i: dict(s) for i, s in inner["state"].items()}
        keys = sorted({k for i, s in state.items() for k, v in s.items()
                       if self._per_element(v, self.pieces[i].shape)})
        flat = self._flat() if keys else None
        for key in keys:
            own = [state[i][key] for i, piece in enumerate(self.pieces) if piece.numel() and i in state]
            mine = torch.zeros_like(self.shard)
            if own:
                torch.cat(own, out=mine[:self.owned])
            all_gather_single(flat, mine, group=self.process_group)
            for i, (t, p) in enumerate(zip(flat[:self.total].split(self.sizes), self.params)):
                if i in state:  # into host memory at once: a GPU would otherwise hold the whole state, 3x a shard's
                    state[i][key] = t.view_as(p).to("cpu", copy=True)
        groups = [{**{k: v for k, v in outer.items() if k != "params"}, "params": g["params"]}
                  for outer, g in zip(self.param_groups, inner["param_groups"])]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from any world size, sharded or not): keep this rank's part of each tensor."""
        state = {}
        for i, s in state_dict["state"].items():
            a, b = self.spans[i]
            state[i] = {k: v.reshape(-1)[a:b].clone() if self._per_element(v, self.params[i].shape) else v
                        for k, v in s.items()}
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})


def _lamb(groups: Groups, sharded: ShardedOptimizer, cfg: OptimConfig, lr: Tensor) -> torch.optim.Optimizer:
    # Always the foreach Lamb: apex's FusedLAMB computes its norms inside one kernel, with no cross-rank step.
    return Lamb(groups, lr=lr, betas=(cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2), eps=cfg.opt_epsilon,
                tensor_norms=sharded.tensor_norms)


def _adamw(groups: Groups, sharded: ShardedOptimizer, cfg: OptimConfig, lr: Tensor) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2), eps=cfg.opt_epsilon,
                             fused=True)


SHARDABLE: dict[str, Callable[..., torch.optim.Optimizer]] = {"lamb": _lamb, "adam": _adamw}


def build_sharded(groups: Groups, cfg: OptimConfig, lr: Tensor,
                  process_group: dist.ProcessGroup | None = None) -> ShardedOptimizer:
    if cfg.optimizer not in SHARDABLE:
        raise ValueError(f"OPTIMIZER_SHARDING=1 supports OPTIMIZER={'|'.join(SHARDABLE)}, got {cfg.optimizer!r}")
    clip_after = cfg.max_grad_norm if cfg.grad_clip == "after" else None
    return ShardedOptimizer(groups, lambda g, s: SHARDABLE[cfg.optimizer](g, s, cfg, lr), clip_after, process_group)
