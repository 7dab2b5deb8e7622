"""Rank layout from torchrun's or Slurm's environment (bert.dist.env)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert.config import launcher_layout
from bert.dist.env import DistEnv, first_slurm_host, read_env

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_variables():
    env = read_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert env == DistEnv(5, 8, 1, 4, "node7", 1234)


def test_slurm_variables_when_launched_by_srun():
    env = read_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[03-04]"})
    assert env == DistEnv(6, 8, 2, 4, "gpu03", 29500)


def test_torchrun_wins_over_slurm_and_a_lone_process_is_rank_0():
    both = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert read_env(both).rank == 1
    assert read_env({}) == DistEnv(0, 1, 0, 1, "localhost", 29500)


def test_srun_variables_under_torchruns_names_keep_the_node_size():
    """enroot's PyTorch hook (pyxis sites) and many site wrappers export RANK/WORLD_SIZE/LOCAL_RANK from srun's
    variables but no LOCAL_WORLD_SIZE: the node is Slurm's tasks per node, not the whole job (which would make a
    hierarchical sum one flat ring over the network and a per-node presort world-wide)."""
    hook = {"RANK": "9", "WORLD_SIZE": "64", "LOCAL_RANK": "1", "MASTER_ADDR": "dgx01", "MASTER_PORT": "6077",
            "SLURM_PROCID": "9", "SLURM_NTASKS": "64", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8",
            "SLURM_STEP_TASKS_PER_NODE": "8(x8)", "SLURM_JOB_NODELIST": "dgx[01-08]"}
    assert read_env(hook) == DistEnv(9, 64, 1, 8, "dgx01", 6077)
    assert launcher_layout(hook) == ((64, "$SLURM_NTASKS"), (8, "$SLURM_STEP_TASKS_PER_NODE"))
    # torchrun inside one srun task per node states its own node size; a bare torchrun job is one node
    torchrun = {**hook, "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS": "8"}
    assert read_env(torchrun).local_world_size == 2 and launcher_layout(torchrun)[1] == (2, "$LOCAL_WORLD_SIZE")
    assert read_env({"RANK": "0", "WORLD_SIZE": "4", "SLURM_NTASKS": "1"}).local_world_size == 4


def test_the_steps_own_tasks_per_node_and_this_nodes_entry():
    """SLURM_NTASKS_PER_NODE may be the allocation's (sbatch --ntasks-per-node=4), inherited by a step launched with
    another layout; the step's SLURM_STEP_TASKS_PER_NODE says what this step runs, one entry per node."""
    from bert.dist.slurm import tasks_per_node

    step = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}
    assert read_env(step).local_world_size == 8 and launcher_layout(step)[1] == (8, "$SLURM_STEP_TASKS_PER_NODE")
    uneven = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert [tasks_per_node({**uneven, "SLURM_NODEID": str(n)}) for n in range(4)] == \
        [(2, "SLURM_STEP_TASKS_PER_NODE")] * 3 + [(1, "SLURM_STEP_TASKS_PER_NODE")]
    assert tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "eight"}) is None and tasks_per_node({}) is None


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("gpu[07,09-10]", "gpu07"),
                                            ("a[2-3],b[1-2]", "a2"), ("cpu-01,cpu-02", "cpu-01"),
                                            ("rack[2-3]-node[07,09-10],x1", "rack2-node07")])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_bad_rank_value_names_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        read_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("gpus,local_rank,chosen", [(8, 5, 5), (1, 5, 0), (4, 5, None), (4, 3, 3)])
def test_each_local_rank_gets_its_own_gpu_or_a_one_line_error(monkeypatch, gpus, local_rank, chosen):
    """GPU local_rank of the node's GPUs, or the one GPU a task sees (srun --gpus-per-task=1); more local ranks than
    GPUs would have put two ranks on one GPU, which NCCL refuses later as a nameless init failure."""
    import torch

    from bert.dist.env import compute_device

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: picked[-1])
    env = DistEnv(local_rank, 8, local_rank, 8, "localhost", 29500)
    if chosen is None:
        with pytest.raises(ValueError, match=f"local rank {local_rank} has no GPU of its own: this node shows {gpus}"):
            compute_device(env)
        assert picked == []
    else:
        assert compute_device(env) == torch.device("cuda", chosen)


def test_device_cuda_without_a_gpu_is_one_line_and_cpu_stays_on_the_cpu(monkeypatch):
    """DEVICE=cuda (the DGX configs): a task that sees no GPU (a CPU-only torch, a cgroup that hides the GPUs) stops
    instead of training a GPU config on the CPU until the walltime; DEVICE=cpu leaves a node's GPUs alone."""
    import torch

    from bert.dist.env import compute_device

    env = DistEnv(1, 8, 1, 8, "localhost", 29500)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^DEVICE=cuda, but torch \S+ \((a CPU-only build|built for CUDA \S+)\) sees "
                                         "no GPU on this node"):
        compute_device(env, "cuda")
    assert compute_device(env) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("DEVICE=cpu took a GPU"))
    assert compute_device(env, "cpu") == torch.device("cpu")


def test_the_open_file_limit_is_raised_to_the_hard_one_before_the_group():
    """A world-wide gloo group holds a socket per rank (1024 at 128 nodes); a job started at a soft limit of 1024
    would fail to create it. Checked in a child whose soft limit starts below its hard one."""
    code = ("import resource; from bert.dist.env import raise_open_file_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(64, hard), hard)); "
            "got = raise_open_file_limit(); print(got == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "True", out.stderr
