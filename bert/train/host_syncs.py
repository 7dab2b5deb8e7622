"""Find the places where the training step makes the host wait for the device, on any device.

On a GPU the host queues kernels ahead of the device, and the step's host work (Python, the attention plan,
launching ~2,000 kernels) hides behind the GPU only while the queue stays ahead. Reading a device value on the
host (`.item()`, `bool(t)`, `float(t)`) or running an op whose output size depends on the values (`nonzero`,
a boolean-mask index, `unique`) empties the queue: the host stops until the GPU has finished everything before
it, then the GPU idles while the host launches the next kernels. Such an op also cannot be captured in a CUDA
graph. torch finds them only on a GPU (`torch.cuda.set_sync_debug_mode`); `count_host_syncs` finds the same ops
as they are dispatched, on the CPU too, with the line of this project's code that asked for each.

Not seen: copies to the host (`.cpu()`, `.tolist()`, `.numpy()`: no-ops on a CPU tensor), and what compiled
code does inside its kernels. The driver keeps host values as host values (`SeqLayout.lengths` is a tuple)
for the first; the second has no host reads of its own. On a GPU `cuda_sync_warnings` sees both, and any
other synchronizing CUDA call (a copy from pageable memory, a stream sync): torch's own detector.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# reads a value on the host (item, bool, int, float of a tensor), or sizes its output by the values
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
           aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount, aten.equal}
MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_}  # sync only when an index is a boolean mask
SIZED_BY = {aten.repeat_interleave}  # the overloads that reach dispatch take a repeats tensor: sync unless sized

HERE = Path(__file__).resolve()
PROJECT = HERE.parents[2]


def _is_sync(func, args, kwargs) -> bool:
    packet = func._overloadpacket
    if packet in SYNCING:
        return True
    if packet in MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet in SIZED_BY:
        return kwargs.get("output_size") is None  # keyword-only in every overload
    return False


def _caller() -> str:
    """The innermost frame in this project's code (tests and benchmarks included; not this module, not an
    environment inside the checkout such as .venv), as path:line."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(PROJECT) and path != HERE and "site-packages" not in path.parts:
            return f"{path.relative_to(PROJECT)}:{frame.lineno}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """Counts the syncing ops dispatched on this thread (and the autograd threads it starts) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.found: Counter[tuple[str, str]] = Counter()  # (op, where) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.found[(func._overloadpacket.__name__, _caller())] += 1
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return sum(self.found.values())

    def report(self) -> list[str]:
        """One line per place: `count x op at where`, most frequent first."""
        return [f"{n} x {op} at {where}" for (op, where), n in self.found.most_common()]


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """`with count_host_syncs() as syncs: train_step(...)`, then `syncs.count` and `syncs.report()`."""
    mode = HostSyncs()
    with mode:
        yield mode


@contextmanager
def cuda_sync_warnings() -> Iterator[list[str]]:
    """On a GPU: the messages of torch's sync debug mode for every synchronizing CUDA call made inside (the list
    is filled when the block ends)."""
    found: list[str] = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # torch's message names its own C++ line; where the Python call was is the warning's location
    found.extend(f"{str(w.message).splitlines()[0].split(' (Triggered')[0]} at {w.filename}:{w.lineno}"
                 for w in caught if "synchroniz" in str(w.message))
