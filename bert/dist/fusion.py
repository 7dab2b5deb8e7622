"""Balanced fusion buffers (Herring [003] §III-1, §III-2, §III-A): gradient buckets of equal byte size.

DDP cannot make them: a DDP bucket holds whole parameters, and BERT-large's word embedding alone
(30528 x 1024 fp32, 125 MB) is five times the default 25 MB bucket, so DDP's buckets, once rebuilt in
gradient-ready order, range from 32 MiB (one encoder layer) to 121 MiB (`bench/comm.py` prints the spread).
Herring instead lays all gradients out in one flat buffer and cuts it into B slices of equal size, splitting a
parameter across slices when the cut falls inside it. `FusedDataParallel` does that, in place of DDP:

    layout   parameters are placed in the order their gradients became ready in the first backward
             on rank 0, which rank 0 broadcasts (Herring's "without negotiation", Fig. 3-4); until then
             (the first step) in reverse registration order, DDP's own first guess.
             B = ceil(total bytes / bucket_cap_mb); the slice sizes differ by at most one element.
    backward a post-accumulate-grad hook copies each gradient into its place (later steps accumulate
             there directly: `.grad` is a view into the flat buffer, like DDP's gradient_as_bucket_view)
             and, when a slice and every slice before it are complete, hands the slice to the comm hook,
             so the reduction starts while the backward pass goes on. Slices start in index order on
             every rank, because gloo and NCCL match collectives by call order.
    end      a callback queued on the autograd engine waits for every slice's Future and copies the
             result back if the hook returned another tensor (as DDP does).

The comm hook is the same `(state, bucket) -> Future[Tensor]` contract as DDP's, so every clipping
mode of `bert.dist.clip` and every `Reduce` of `bert.dist.reduce` runs on it unchanged. For bucket-wise
clipping (Samsung [000] Algorithm 1) B is `num_buckets()`: a constant, since it depends only on the
total size and the cap, not on the order.

Unlike DDP, module buffers are broadcast from rank 0 once, at wrap time, not before every forward
(BERT's buffers are constants), and a parameter that gets no gradient in a step counts as a zero.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from bert.dist.reduce import allreduce_mean, reduce_hook

MB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB


def balanced_bounds(total: int, buckets: int) -> list[int]:
    """Cut `total` elements into `buckets` contiguous slices whose sizes differ by at most one."""
    return [total * k // buckets for k in range(buckets + 1)]


def bucket_count(total_bytes: int, cap_bytes: float) -> int:
    """B: as many equal slices as the cap needs (Herring sizes them from the model; we take DDP's cap)."""
    return max(1, math.ceil(total_bytes / cap_bytes))


class FusionBucket:
    """What a comm hook receives: the part of `dist.GradBucket`'s interface the hooks use."""

    def __init__(self, buffer: Tensor, index: int, count: int):
        self._buffer, self._index, self._count = buffer, index, count

    def buffer(self) -> Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1


class FusedDataParallel(nn.Module):
    """Data parallelism over balanced fusion buffers; a drop-in for the parts of DDP the harness uses
    (`module`, forward, `no_sync`, `register_comm_hook`)."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError("balanced fusion buffers need one gradient dtype, "
                             f"the model has {sorted(map(str, dtypes))}")
        self.cap_bytes = bucket_cap_mb * MB
        with torch.no_grad():  # DDP's start: every rank holds rank 0's weights and buffers
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0, group=group)
        self._hook: Callable = reduce_hook(allreduce_mean(group))
        self._state: object = None
        self._sync = True  # no_sync() turns it off; read at forward, like DDP
        self._armed = False  # this backward reduces
        self.local_ready_order: list[int] | None = None  # first sync backward's order on this rank
        self._recording: list[int] | None = []
        self._order_fixed = False
        self._set_layout(list(reversed(range(len(self.params)))))
        # The hooks live on the parameters and hold only a weak reference to the wrapper, and they are removed
        # when it is collected: a wrapper that is dropped (a benchmark building several) is freed with its buffer.
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_weak_grad_hook(me, i)) for i, p in enumerate(self.params)]
        weakref.finalize(self, _remove, handles)

    # ---- layout --------------------------------------------------------------------------------
    def _set_layout(self, order: list[int]) -> None:
        """Place the parameters in `order` in a new flat buffer cut into equal slices; gradients that
        exist move with them."""
        self.order = list(order)
        numels = [p.numel() for p in self.params]
        total = sum(numels)
        first = self.params[0]
        flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        count = bucket_count(total * first.element_size(), self.cap_bytes)
        self.bounds = balanced_bounds(total, count)
        self.buffers = [flat[a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        self.views: list[Tensor] = [flat] * len(self.params)
        self.spans: list[list[tuple[int, int]]] = [[] for _ in self.params]  # (slice, elements in it)
        offset = 0
        for i in self.order:
            p, n = self.params[i], numels[i]
            self.views[i] = flat[offset:offset + n].view_as(p)
            for k in range(count):
                inside = min(offset + n, self.bounds[k + 1]) - max(offset, self.bounds[k])
                if inside > 0:
                    self.spans[i].append((k, inside))
            if p.grad is not None:
                self.views[i].copy_(p.grad)
                p.grad = self.views[i]
            offset += n
        self.flat = flat
        self._reset()

    def _fix_order(self) -> None:
        """Herring's order without negotiation: rank 0's first ready order, broadcast to every rank."""
        # on the gradients' device: NCCL takes no host tensor (the driver's group on a GPU is NCCL alone). The
        # `tolist` below waits for it, once per run.
        order = torch.tensor(self.local_ready_order, dtype=torch.int64, device=self.flat.device)
        dist.broadcast(order, 0, group=self.group)
        self._order_fixed = True
        self._set_layout(order.tolist())

    def num_buckets(self) -> int:
        return len(self.buffers)

    def bucket_bytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b in self.buffers]

    # ---- DDP's interface -----------------------------------------------------------------------
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """`hook(state, bucket) -> Future[Tensor]` averages one slice, as a DDP comm hook does."""
        self._state, self._hook = state, hook

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run in here accumulate locally; the next synced one reduces the sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def forward(self, *args, **kwargs):
        if self.local_ready_order is not None and not self._order_fixed:
            self._fix_order()  # in the forward, as DDP rebuilds its buckets: no collective inside backward
        self._armed = self._sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    # ---- backward ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._pending = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self._arrived = [False] * len(self.params)
        self._next = 0
        self._futures: list[Future] = []
        self._queued = False
        self.arrived_at_launch: list[int] = []  # gradients in place when each slice started (overlap)

    def _grad_ready(self, i: int) -> None:
        """Parameter i's gradient is accumulated: place it; start every slice that is now complete."""
        if not self._armed:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if self._recording is not None:
            self._recording.append(i)
        self._place(i)
        self._launch_ready()

    def _place(self, i: int) -> None:
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():  # a fresh .grad (after zero_grad(set_to_none=True))
            view.copy_(p.grad)
        p.grad = view
        self._arrived[i] = True
        for k, n in self.spans[i]:
            self._pending[k] -= n

    def _launch_ready(self) -> None:
        while self._next < len(self.buffers) and self._pending[self._next] == 0:
            self.arrived_at_launch.append(sum(self._arrived))
            bucket = FusionBucket(self.buffers[self._next], self._next, len(self.buffers))
            self._futures.append(self._hook(self._state, bucket))
            self._next += 1

    def _finish(self) -> None:
        for i, arrived in enumerate(self._arrived):  # parameters without a gradient this step
            if not arrived:
                self._place(i)
        self._launch_ready()
        for buffer, fut in zip(self.buffers, self._futures):
            value = fut.wait()
            value = value[0] if isinstance(value, list | tuple) else value
            if value.data_ptr() != buffer.data_ptr():
                buffer.copy_(value)
        if self._recording is not None:
            # Unused parameters go last, so the order is a permutation on every rank.
            seen = set(self._recording)
            self.local_ready_order = self._recording + [i for i in reversed(range(len(self.params))) if i not in seen]
            self._recording = None
        self._armed = False
        launched = self.arrived_at_launch
        self._reset()
        self.arrived_at_launch = launched


def _weak_grad_hook(wrapper: weakref.ref, i: int) -> Callable[[Tensor], None]:
    """Parameter i's post-accumulate-grad hook: calls the wrapper while it lives, does nothing after."""

    def hook(p: Tensor) -> None:
        live = wrapper()
        if live is not None:
            live._grad_ready(i)

    return hook


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


def ddp_bucket_bytes(shapes_in_ready_order: list[tuple[int, ...]], element_size: int, cap_mb: float,
                     first_bucket_bytes: int | None = None) -> list[int]:
    """Byte sizes of the buckets DDP builds for gradients that become ready in this order, using torch's own
    assignment function on meta tensors (no memory). `first_bucket_bytes` (DDP's 1 MiB when the cap is the
    default) caps the first bucket only."""
    dtype = {2: torch.float16, 4: torch.float32, 8: torch.float64}[element_size]
    tensors = [torch.empty(s, dtype=dtype, device="meta") for s in shapes_in_ready_order]
    cap = int(cap_mb * MB)
    limits = [first_bucket_bytes, cap] if first_bucket_bytes and first_bucket_bytes < cap else [cap]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors),
                                                         list(range(len(tensors))))
    return [sum(tensors[i].numel() for i in b) * element_size for b in buckets]
