"""The tests' gloo ranks: processes forked from one preloaded interpreter instead of spawned.

`mp.spawn` starts a fresh interpreter per rank, and each imports torch and dynamo again: about 4 s of CPU apiece,
and the suite started 47 (a process probe, docs/journal.md: "The suite under 15 minutes"). A forkserver imports them
once per test worker and forks every rank from that idle interpreter. Not a fork of the pytest worker itself: after
earlier tests its threads may hold a lock at the fork, and a child stuck on it left the others waiting in the gloo
rendezvous (CI, 2026-11-24). The ranks take the environment the server started with, so a rank must not read a
variable its test sets (none does: they meet through a FileStore or a port passed as an argument).
CUDA ranks keep `mp.spawn`: nothing here has measured a forkserver's children on a GPU.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]  # what every rank imports; the test module is cheap


def start_ranks(fn: Callable[..., None], args: tuple = (), nprocs: int = 1, join: bool = True):
    """`mp.spawn(fn, args, nprocs, join)` with the ranks forked from the preloaded server."""
    import torch.multiprocessing as mp  # here: a test module that starts no rank need not import torch

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the worker's first call
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
