"""Rank layout from torchrun's or Slurm's environment (bert.dist.env)."""

from __future__ import annotations

import pytest

from bert.dist.env import DistEnv, first_slurm_host, read_env


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


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("gpu[07,09-10]", "gpu07"),
                                            ("a[2-3],b[1-2]", "a2"), ("cpu-01,cpu-02", "cpu-01")])
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
