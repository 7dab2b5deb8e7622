"""Checkpoints that resume exactly: weights, optimizer, LR schedule, loss scaler, sampler, RNG.

    <output_dir>/checkpoints/step_00001200/model.safetensors   rank 0: the weights, fp32 (the masters under
                                                               MASTER_WEIGHTS=1)
                                          /train_state.pt      rank 0: optimizer, schedule, scaler, counters
                                          /rank_00003.pt       every rank: its sampler position, RNG and
                                                               float8 amaxes (FP8_RECIPE=delayed)
    <output_dir>/checkpoints/latest                            the name of the newest complete checkpoint

`latest` is written by rank 0 after a barrier, so a job killed mid-save leaves the previous
checkpoint as the one to resume from. Every file is flushed to disk (fsync) by its writer before that barrier,
then by rank 0 the folder (every rank's entry) and the pointer, before and after its rename: on Lustre `close()`
leaves data in the page cache while a rename is committed at once, so a node lost after the rename would
otherwise leave `latest` naming truncated files.
A rank the saving job did not have (a job continued on more GPUs) takes rank 0's per-rank parts (the loader's
position, the float8 amaxes) and keeps its RNG.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bert.dist.env import barrier
from bert.model.checkpoint import load_weights, save_weights
from bert.optim.master import fp32_weights

LATEST = "latest"


def _to_disk(path: Path) -> None:
    """fsync a file written by path (torch.save, safetensors), or a directory (its entries: a rename). Some file
    systems refuse fsync on a directory (EINVAL): there the rename is as durable as they make it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not path.is_dir() or e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # a run on a GPU (DEVICE=cpu on a GPU node makes no CUDA context for it)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, model: nn.Module, parts: dict[str, Any], rank: int,
                    rank_parts: dict[str, Any]) -> Path:
    """`parts` (objects with state_dict, or plain values) are shared by all ranks; `rank_parts` are per rank."""
    root = Path(output_dir) / "checkpoints"
    where = root / f"step_{step:08d}"
    if rank == 0:
        where.mkdir(parents=True, exist_ok=True)
    barrier()
    states = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in rank_parts.items()}
    written = [where / f"rank_{rank:05d}.pt"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.save({**states, "rng": _rng_state(), "world_size": world}, written[0])
    # On every rank: a sharded optimizer's state_dict is a collective (it gathers the whole state).
    shared = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in parts.items()}
    with fp32_weights(parts.get("optimizer")):  # MASTER_WEIGHTS=1: the fp32 masters (sharded: gathered by all)
        if rank == 0:
            save_weights(model, where / "model.safetensors")
    if rank == 0:
        torch.save(shared, where / "train_state.pt")
        written += [where / "model.safetensors", where / "train_state.pt"]
    for path in written:
        _to_disk(path)
    barrier()
    if rank == 0:
        _to_disk(where)  # every rank's entry is in it now
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(where.name)
        _to_disk(tmp)
        os.replace(tmp, root / LATEST)
        _to_disk(root)
    return where


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    pointer = Path(output_dir) / "checkpoints" / LATEST
    return pointer.parent / pointer.read_text().strip() if pointer.is_file() else None


def on_device(device: torch.device) -> Callable[[Any, str], Any]:
    """torch.load's map_location for a file another rank wrote: its CUDA tensors onto `device` (on a CPU, the host),
    its host tensors (RNG states) left on the host."""
    def place(storage: Any, location: str) -> Any:
        if not location.startswith("cuda"):
            return storage
        return storage.cuda(device.index) if device.type == "cuda" else storage.cpu()
    return place


def load_checkpoint(where: Path, model: nn.Module, parts: dict[str, Any], rank: int,
                    rank_parts: dict[str, Any]) -> dict[str, Any]:
    """Restore every stateful part in place; returns the plain (non-stateful) shared values."""
    mine, first = where / f"rank_{rank:05d}.pt", where / "rank_00000.pt"
    # A rank the saving job did not have (a job continued on more GPUs) takes rank 0's per-rank parts (the loader's
    # state: where the whole job was, from which it finds this rank's next batch) and keeps its own seeded RNG.
    grown = not mine.is_file()
    if grown and not first.is_file():
        raise FileNotFoundError(f"{where}: no rank_00000.pt, so not a whole checkpoint")
    own = torch.load(first if grown else mine, weights_only=False)
    saved_world = own.get("world_size", len(list(where.glob("rank_*.pt"))))
    if grown and rank < saved_world:
        raise FileNotFoundError(f"{mine} is missing from a checkpoint of {saved_world} ranks")
    with fp32_weights(parts.get("optimizer")):
        load_weights(model, where / "model.safetensors")
    # rank 0 wrote it from its own GPU: onto this rank's device, not every rank onto cuda:0 (a context and a copy of
    # the optimizer state each, held there for the rest of the run)
    shared = torch.load(where / "train_state.pt", weights_only=False,
                        map_location=on_device(next(model.parameters()).device))
    values = {}
    for key, state in shared.items():
        if hasattr(parts.get(key), "load_state_dict"):
            parts[key].load_state_dict(state)
        else:
            values[key] = state
    for key, part in rank_parts.items():
        if key in own or not getattr(part, "missing_ok", False):  # a part the checkpoint may predate keeps its start
            part.load_state_dict(own[key])
    if not grown:
        _set_rng_state(own["rng"])
    return values
