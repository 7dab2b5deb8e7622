"""Who am I in the job: rank, world size and node-local rank from torchrun or Slurm.

torchrun exports RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT; `srun`
exports only SLURM_* variables, so those are translated here instead of in a wrapper script.
A job that is neither is a single process.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bert.dist.slurm import first_slurm_host, tasks_per_node

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"${name}={environ[name]!r} is not an integer") from None


def slurm_tasks(environ: Mapping[str, str]) -> int | None:
    found = tasks_per_node(environ)
    return found[0] if found else None


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank layout from torchrun's variables, else Slurm's, else a single process."""
    environ = os.environ if environ is None else environ
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_PORT
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        if "LOCAL_WORLD_SIZE" in environ:
            local_world = _int(environ, "LOCAL_WORLD_SIZE")
        elif environ.get("SLURM_NTASKS") == environ["WORLD_SIZE"]:
            # srun's variables translated to torchrun's (enroot's PyTorch hook, a site's wrapper) leave this one out
            local_world = slurm_tasks(environ) or world
        else:
            local_world = world
        return DistEnv(_int(environ, "RANK"), world, _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
                       local_world, environ.get("MASTER_ADDR", "localhost"), port)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        local_world = slurm_tasks(environ) or _int(environ, "SLURM_NTASKS")
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        addr = environ.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "localhost")
        return DistEnv(_int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS"),
                       _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                       local_world, addr, port)
    return DistEnv(0, 1, 0, 1, "localhost", port)


def device_type(want: str) -> str:
    """"cuda" or "cpu" for DEVICE=`want` on this node (the driver's choice and its pre-launch check's). DEVICE=cuda
    without a GPU is a ValueError in one line, rather than a GPU config crawling on the CPU."""
    if want == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"DEVICE=cuda, but torch {torch.__version__} ({build}) sees no GPU on this node: ask Slurm "
                         "for the node's GPUs (--gpus-per-node where they are a gres) and run the image's torch, or "
                         "set DEVICE=auto to train on the CPU")
    return "cuda" if want != "cpu" and torch.cuda.is_available() else "cpu"


def compute_device(env: DistEnv, want: str = "auto") -> torch.device:
    """One GPU per local rank when there are GPUs (`want`: auto or cuda), else the CPU, its cores shared among the
    local ranks."""
    if device_type(want) == "cuda":
        gpus = torch.cuda.device_count()
        if gpus > 1 and env.local_rank >= gpus:  # one GPU visible per task (srun --gpus-per-task=1) is GPU 0 for all
            raise ValueError(f"local rank {env.local_rank} has no GPU of its own: this node shows {gpus} GPUs "
                             f"to {env.local_world_size} local ranks (DGXNGPU or --nproc_per_node too large?)")
        torch.cuda.set_device(env.local_rank % gpus)
        return torch.device("cuda", torch.cuda.current_device())
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; srun does not, and oversubscribed threads spin
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    return torch.device("cpu")


def raise_open_file_limit() -> int:
    """Lift this process's soft limit on open files to the hard one, and return it. A gloo group holds a socket per
    rank of the world (the stop flag's: 1024 at 128 nodes) and the reader keeps a quarter of the limit in shards
    open; sites often start jobs at a soft limit of 1024, which srun passes on from the submitting shell. The driver
    calls it first thing, before any group (the parameter servers' included)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit the kernel will not take as a soft one
            return soft
    return hard


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float, store: dist.Store | None = None) -> None:
    """Join the process group. The timeout bounds how long survivors wait for a dead rank. `store`: a
    rendezvous already made (the workers' part of a job with parameter servers, `bert.dist.ps`)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A single process still gets a (trivial) group so that DDP and its clipping hooks run unchanged.
    where = {"init_method": f"tcp://{env.master_addr}:{env.master_port}"} if env.distributed else {
        "store": dist.HashStore()}
    if store is not None:
        where = {"store": store}
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None, **where)


def barrier() -> None:
    """Every rank of the default group waits for the others; nothing without a group (a bare single process)."""
    if dist.is_initialized():
        dist.barrier()
