"""The training input pipeline: plan, read, collate in the background, hand over on the device.

    loader = TrainLoader(input_dir, local_batch_size, world_size, rank, ranks_per_node, strategy="samsung")
    for batch in loader:  # endless, across epochs; a `bert.batch.Batch` already on `device`
        ...

Epochs, strata and remainders are defined in `bert.data.epoch`; the plan shared by all
ranks in `bert.data.plan`. A step's batch is this rank's row of the balanced assignment,
read from the shards in assignment order and collated on the CPU in a background thread
(`bert.data.prefetch`) or, with LOADER_WORKER=process, a child process
(`bert.data.process_prefetch`), so `SeqLayout.lengths`/`max_seqlen` are host values and the
training step never waits on the device to learn them. On CUDA the batch is pinned by a
thread and copied with `non_blocking=True` on the consumer's current stream, which orders
the copy before the step's kernels with no host synchronisation.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from bert.balance import Strategy
from bert.batch import Batch, collate
from bert.data.eval_set import EvalSet, eval_batches
from bert.data.index import LengthIndex
from bert.data.limits import SampleLimits
from bert.data.plan import TrainPlan
from bert.data.prefetch import Prefetcher
from bert.data.process_prefetch import LOADER_WORKERS, ProcessPrefetcher
from bert.data.reader import SampleReader
from bert.static_shapes import pad_static

__all__ = ["EvalSet", "TrainLoader", "eval_batches"]


class TrainLoader:
    def __init__(
        self,
        input_dir: str | os.PathLike,
        local_batch_size: int,
        world_size: int,
        rank: int,
        ranks_per_node: int,
        strategy: str | Strategy = "none",
        seed: int = 0,
        shuffle_buffer: int = 10000,
        device: torch.device | str = "cpu",
        prefetch: int = 2,
        static_tokens: int = 0,
        limits: SampleLimits | None = None,
        worker: str = "thread",
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if worker not in LOADER_WORKERS:  # before the scan of the shards
            raise ValueError(f"LOADER_WORKER={worker!r}: one of {', '.join(LOADER_WORKERS)}")
        self.plan = TrainPlan(
            LengthIndex.scan(input_dir), world_size, local_batch_size, ranks_per_node, strategy, seed, shuffle_buffer
        )
        self.limits = limits  # what the model takes (bert.data.limits): every batch is checked against it
        if limits is not None:
            limits.check_index(self.plan.index)
        self.rank, self.device, self.prefetch = rank, torch.device(device), prefetch
        self.static_tokens = static_tokens  # STATIC_TOKENS: pad to token buckets (bert.static_shapes), 0 = off
        self.step = 0  # batches handed to the caller so far
        self.worker = worker  # where batches are read and collated: a thread, or a child process
        self._reader = SampleReader(self.plan.index)
        self._worker: Prefetcher | ProcessPrefetcher | None = None

    @property
    def sample_lengths(self) -> np.ndarray:
        """Tokens per sample of the whole training set (the index the plan draws from)."""
        return self.plan.index.lengths

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all ranks together (MLPerf counts epochs in samples)."""
        return self.step * self.plan.global_batch_size

    def plan_ahead(self) -> None:
        """Lay out the epoch of the next batch now, in the untimed initialisation. Its first batch would do it in
        the prefetch thread: every rank orders the whole training set, about 40 s for phase 2's 156.7 M samples
        (one core, 1024 ranks), which at 128 nodes is as long as the timed run. Only the length index is read.
        LOADER_WORKER=process: the child process is forked now too, with the epoch laid out; it reads no sample
        before the first batch is asked for (bert.data.process_prefetch)."""
        self.plan.draw(self.step)
        if self.worker == "process":
            self._started()

    def _batch(self, step: int) -> Batch:
        ids = self.plan.rank_ids(step, self.rank)
        batch = collate(self._reader.read(ids))
        if self.limits is not None:
            self.limits.check(batch, self.plan.index, ids)
        # Padded here, in the background (thread or process) and before pinning: on the device the new cu_seqlens
        # would be a pageable host-to-device copy, which waits for the stream, in every training step.
        return pad_static(batch, self.static_tokens)

    def _started(self) -> Prefetcher | ProcessPrefetcher:
        if self._worker is None:
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            kind = ProcessPrefetcher if self.worker == "process" else Prefetcher
            self._worker = kind(self._batch, self.step, self.prefetch, pin)
        return self._worker

    def __iter__(self) -> TrainLoader:
        self._started()
        return self

    def __next__(self) -> Batch:
        batch = self._started().next()
        self.step += 1
        return batch.to(self.device, non_blocking=True)

    def state_dict(self) -> dict:
        plan = self.plan
        return {
            "step": self.step,
            "seed": plan.seed,
            "world_size": plan.world_size,
            "local_batch_size": plan.local_batch_size,
            "ranks_per_node": plan.ranks_per_node,
            "strategy": plan.strategy.name,
            "shuffle_buffer": plan.shuffle_buffer,
            "num_samples": plan.index.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the next batch is the one that followed when it was saved.

        Saved at another world size (a checkpoint is whole, so a job may continue on more or fewer GPUs),
        the plan cannot be the same: the loader continues this plan at the first step at or past the
        samples already consumed, so the sample count carries over but this epoch's order does not. A run
        continued so is not a result anyway (bert.train.mlperf_log labels every continuation)."""
        mine = self.state_dict()
        differ = {k: (state.get(k), v) for k, v in mine.items() if k != "step" and state.get(k) != v}
        if differ and set(differ) <= {"world_size", "ranks_per_node"}:
            consumed = int(state["step"]) * int(state["world_size"]) * int(state["local_batch_size"])
            step = -(-consumed // self.plan.global_batch_size)
            if self.rank == 0:
                print(f"data: resuming a plan made for {state['world_size']} ranks on {self.plan.world_size}: "
                      f"continuing at step {step} ({consumed} samples consumed); this epoch's order differs",
                      flush=True)
            self.close()
            self.step = step
            return
        if differ:
            raise ValueError(f"loader state was saved with a different plan (saved, now): {differ}")
        self.close()
        self.step = int(state["step"])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._reader.close()
