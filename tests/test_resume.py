"""Resume is exact: N steps, stop, --resume for N more == 2N steps in one go (weights and every loss).

Single-process runs of the real driver on the synthetic dataset, with dropout on, so the RNG state,
the sampler position, the optimizer moments, the LR schedule and the step counters all have to
come back from the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
N = 4


def driver(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = dict(input_dir=data / "train_varlength", eval_dir=data / "eval_varlength", bert_config_path="tiny",
                output_dir=out, train_batch_size=8, learning_rate=3e-3, max_steps=2 * N, warmup_steps=2, log_freq=1,
                eval_iter_start_samples=10**9, num_eval_examples=64, attention="padded", seed=11)
    cmd = [sys.executable, str(ROOT / "run_pretraining.py"), *[x for k, v in args.items() for x in (f"--{k}", str(v))],
           *extra]
    # One thread per process: two runs share the 2 cores, and oversubscribed OpenMP threads spin.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{2 * N:08d}"
    return load_file(out / "checkpoints" / latest / "model.safetensors")


@pytest.mark.slow
def test_n_plus_n_steps_equal_2n_steps(tmp_path):
    """The resumed run continues bit for bit. (Master weights: the checkpoint holds the fp32 masters and
    resumes exactly, tests/test_master_weights.py; the driver-level case here cost 16 s of CI for the same
    checkpoint code.)"""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "data/make_synthetic_dataset.py"), "--out", str(data),
                    "--train-samples", "256", "--eval-samples", "64"], check=True, capture_output=True)
    whole, split = tmp_path / "whole", tmp_path / "split"
    jobs = [driver(data, whole), driver(data, split, "--steps_this_job", str(N))]
    (rc_whole, log_whole), (rc_first, log_first) = map(finish, jobs)
    assert rc_whole == 1, log_whole[-3000:]  # max_steps before the target: aborted
    assert rc_first == 0, log_first[-3000:]  # pre-empted after a checkpoint
    assert (split / "checkpoints" / "latest").read_text().strip() == f"step_{N:08d}"
    rc_second, log_second = finish(driver(data, split, "--resume", "1"))
    assert rc_second == 1, log_second[-3000:]

    assert len(losses(whole)) == 2 * N
    assert losses(split) == losses(whole)
    a, b = final_weights(whole), final_weights(split)
    assert a.keys() == b.keys() and {t.dtype for t in a.values()} == {torch.float32}
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The comparison is not vacuous: training moved the weights.
    first = load_file(split / "checkpoints" / f"step_{N:08d}" / "model.safetensors")
    assert any(not torch.equal(first[n], a[n]) for n in a)


def test_the_shared_state_is_loaded_onto_this_ranks_device(tmp_path):
    """train_state.pt is rank 0's (written from its GPU): every rank maps its CUDA tensors onto its own device, not
    onto cuda:0 (eight ranks would each make a context there and keep a copy of the optimizer state), and onto the
    host on a CPU; host tensors (RNG states) stay on the host. Here the map function itself, as torch.load calls it
    (a storage read on the host and where it was written); on a GPU a real file too."""
    from bert.train.checkpoint import on_device

    storage = torch.arange(3.0).untyped_storage()
    place = on_device(torch.device("cpu"))
    assert place(storage, "cuda:0").device.type == "cpu" and place(storage, "cpu") is storage
    if torch.cuda.is_available():
        last = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.save({"m": torch.ones(2, device="cuda:0"), "rng": torch.get_rng_state()}, tmp_path / "state.pt")
        loaded = torch.load(tmp_path / "state.pt", map_location=on_device(last), weights_only=False)
        assert loaded["m"].device == last and loaded["rng"].device.type == "cpu"


@pytest.mark.parametrize("master", [False, True], ids=["plain", "master-weights"])
def test_a_resumed_optimizer_keeps_its_own_kernels(master):
    """torch's load_state_dict takes every group key from the checkpoint: without `keep_implementation` a fused AdamW
    resumed from a compiled step's checkpoint (COMPILE_OPTIMIZER=1: foreach, capturable on a GPU) ran foreach, and the
    reverse put the fused kernel inside the compiled step."""
    from bert.config import from_flat
    from bert.optim import build_optimizer

    def built(compiled: bool) -> torch.optim.Optimizer:
        torch.manual_seed(0)
        cfg = from_flat(optimizer="adam", learning_rate=1e-3, max_steps=10, compile_optimizer=compiled,
                        master_weights=master, precision="bf16" if master else "fp32").optim
        model = torch.nn.Linear(4, 3)
        optimizer = build_optimizer(model, cfg, torch.bfloat16 if master else torch.float32)
        model(torch.ones(2, 4, dtype=model.weight.dtype)).sum().backward()
        optimizer.step()
        return optimizer

    def kernels(optimizer: torch.optim.Optimizer) -> list[tuple]:
        inner = getattr(optimizer, "inner", optimizer)
        return [(g["fused"], g["foreach"], g["capturable"]) for g in [*optimizer.param_groups, *inner.param_groups]]

    for saving, loading in ((True, False), (False, True)):
        resumed = built(loading)
        own = kernels(resumed)
        resumed.load_state_dict(built(saving).state_dict())
        assert kernels(resumed) == own
        resumed.step()  # and it steps with them


def test_a_rank_the_saving_job_did_not_have_takes_the_loader_position_and_keeps_its_own_rng(tmp_path):
    """A job continued on more ranks (checkpoints are whole: "any world size can load them"): a rank without a file
    of its own takes rank 0's loader state, which says where the whole job was (the loader finds this rank's next
    batch from it), and keeps the RNG its seed gave it; it used to stop with FileNotFoundError while the other ranks
    went on into their first collective."""
    from bert.train.checkpoint import load_checkpoint, save_checkpoint

    class Position:
        def __init__(self, step: int):
            self.step = step

        def state_dict(self) -> dict:
            return {"step": self.step}

        def load_state_dict(self, state: dict) -> None:
            self.step = state["step"]

    model = torch.nn.Linear(2, 2)
    torch.manual_seed(1)
    saved_rng = torch.get_rng_state()
    where = save_checkpoint(tmp_path, 5, model, {}, 0, {"loader": Position(7)})
    torch.manual_seed(2)
    own_rng = torch.get_rng_state()
    joined = Position(0)
    load_checkpoint(where, model, {}, 3, {"loader": joined})
    assert joined.step == 7 and torch.equal(torch.get_rng_state(), own_rng)
    load_checkpoint(where, model, {}, 0, {"loader": joined})  # rank 0 gets its own RNG back
    assert torch.equal(torch.get_rng_state(), saved_rng)
    two = torch.load(where / "rank_00000.pt", weights_only=False)  # as if two ranks saved it and rank 1's file is lost
    torch.save({**two, "world_size": 2}, where / "rank_00000.pt")
    with pytest.raises(FileNotFoundError, match="rank_00001.pt is missing from a checkpoint of 2 ranks"):
        load_checkpoint(where, model, {}, 1, {"loader": joined})
    load_checkpoint(where, model, {}, 2, {"loader": joined})  # a third rank joins
    (where / "rank_00000.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no rank_00000.pt"):
        load_checkpoint(where, model, {}, 3, {"loader": joined})


def test_every_checkpoint_file_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    """On Lustre close() leaves data in the page cache while a rename is committed at once: each file, its folder and
    the pointer are fsynced before `latest` is replaced (and its folder after), so a lost node cannot leave `latest`
    naming truncated files."""
    import bert.train.checkpoint as ckpt

    events: list[str] = []
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}"))
    real_replace = os.replace
    monkeypatch.setattr(ckpt.os, "replace", lambda a, b: (events.append(f"replace {b}"), real_replace(a, b)))
    where = ckpt.save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {"state": {"step": 1}}, 0, {})
    root = where.parent
    replaced = events.index(f"replace {root / ckpt.LATEST}")
    synced_before = {e.split(" ", 1)[1] for e in events[:replaced]}
    assert {str(where / n) for n in ("rank_00000.pt", "model.safetensors", "train_state.pt")} | {str(where)} <= \
        synced_before
    assert str(root / f".{ckpt.LATEST}.tmp") in synced_before and events[replaced + 1:] == [f"fsync {root}"]


def test_a_file_system_that_refuses_fsync_on_a_folder_still_gets_the_checkpoint(tmp_path, monkeypatch):
    """Some file systems answer EINVAL to fsync on a directory: the files are still synced and `latest` written; a
    file's fsync failing is still an error."""
    import errno

    import bert.train.checkpoint as ckpt

    real_fsync = os.fsync

    def folders_refuse(fd: int) -> None:
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", folders_refuse)
    where = ckpt.save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {}, 0, {})
    assert ckpt.latest_checkpoint(tmp_path) == where
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        ckpt.save_checkpoint(tmp_path, 2, torch.nn.Linear(2, 2), {}, 0, {})
