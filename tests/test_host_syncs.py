"""Host syncs: `bert.train.host_syncs` finds the ops that sync on a GPU, and the driver's step has none.

* the detector against CUDA's semantics: a table of snippets labelled by what they do on a GPU (reads a device
  value on the host, or sizes an output by the values); on a GPU the same table is checked against torch's own
  `torch.cuda.set_sync_debug_mode("error")`;
* the driver's training step (built by `build_run`, as `bench/host_syncs.py` builds it) has no host sync in
  fp32 and bf16, for every optimizer, clip mode, master weights or not, and the step layouts; `train()` syncs
  once per progress interval (the loss it prints, the mean over the ranks; the LR comes from the host); under
  fp16 master weights and fused AdamW skip an overflowed step on the device, and the one sync per step left is
  GradScaler's check before LAMB on fp32 weights;
* the check can fail: a `.item()` slipped into the step is found and named;
* on a GPU, torch's sync debug mode finds no synchronizing CUDA call in the bf16 step (copies to the host
  included, which the CPU cannot show).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from script_modules import load_script

from bert.train.host_syncs import count_host_syncs

hs = load_script("bench/host_syncs.py")


def _x() -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 3.0, 0.0])


SNIPPETS = {  # name: (what it runs on x, host syncs on a GPU)
    "item": (lambda x: x.sum().item(), 1),
    "bool of a comparison": (lambda x: bool((x > 0).any()), 1),
    "float": (lambda x: float(x.max()), 1),
    "boolean-mask index": (lambda x: x[x > 0], 1),
    # a device value: a Python number would go to masked_fill on CUDA, no sync (the CPU detector counts its item())
    "boolean-mask assignment": (lambda x: x.clone().__setitem__(x > 0, torch.zeros((), device=x.device)), 1),
    "nonzero": (lambda x: x.nonzero(), 1),
    "unique": (lambda x: torch.unique(x), 1),
    # another tensor: CUDA's equal answers True for a tensor and itself at once, with no read of the device
    "equal": (lambda x: torch.equal(x, x.clone()), 1),
    "repeat_interleave by a tensor": (lambda x: torch.repeat_interleave(x.long().abs()), 1),
    "repeat_interleave by an int": (lambda x: x.repeat_interleave(2), 0),
    # indices made on the device: torch.tensor([...], device="cuda") copies from pageable host memory and syncs
    "repeat_interleave with output_size": (lambda x: torch.repeat_interleave(torch.arange(1, 3, device=x.device),
                                                                             output_size=3), 0),
    "integer index": (lambda x: x[torch.arange(0, 3, 2, device=x.device)], 0),
    "index_select": (lambda x: x.index_select(0, torch.ones(1, dtype=torch.long, device=x.device)), 0),
    "where": (lambda x: torch.where(x > 0, x, 0.0), 0),
    "masked_fill": (lambda x: x.masked_fill(x > 0, 0.0), 0),
    "reductions and a clamp by a tensor": (lambda x: x.clamp(max=x.norm()).sum() / x.abs().max(), 0),
    "backward": (lambda x: x.clone().requires_grad_().pow(2).sum().backward(), 0),
}


@pytest.mark.parametrize("name", SNIPPETS)
def test_detector_counts_what_syncs_on_a_gpu(name):
    snippet, expected = SNIPPETS[name]
    with count_host_syncs() as syncs:
        snippet(_x())
    assert syncs.count == expected, syncs.report()
    assert all(where.startswith("tests/test_host_syncs.py:") for _, where in syncs.found)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", SNIPPETS)
def test_labels_agree_with_torch_cuda_sync_debug_mode(name):
    snippet, expected = SNIPPETS[name]
    x = _x().cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        snippet(x)
        synced = False
    except RuntimeError as e:
        assert "synchroniz" in str(e)
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert synced == bool(expected)


@pytest.fixture(scope="module")
def data(world_of_one, one_thread, tmp_path_factory):
    """The random shards and micro BERT config the driver's run is built on, in a world of one. The phase-2 mix at
    half its lengths: per-sequence attention over up to 512 tokens was a third of the module's time, no sync depends
    on a length, and the batches still span two of grouped attention's length groups."""
    return hs.write_random_shards(tmp_path_factory.mktemp("data"), max_length=256)


def test_the_scaled_mix_ends_at_max_length_and_keeps_its_strata(data):
    """The reference: the mix's own strata (bert.lengths.WIKI_PHASE2), halved."""
    from bert.data.format import VarlenShard
    from bert.lengths import WIKI_PHASE2

    with VarlenShard(data / "train_varlength" / "part_00000.hdf5") as shard:
        lengths = np.array([len(s.input_ids) for s in shard])
    assert lengths.max() == 256  # the mix's share at exactly its longest, scaled
    halved = np.array(WIKI_PHASE2.edges) // 2
    assert len(np.unique(np.searchsorted(halved, lengths))) >= 3  # several strata, not one
    with pytest.raises(SystemExit):
        hs.parse_args(["--max-length", "16"])


def measure(data, tmp_path, name: str, device: str = "cpu") -> dict:
    case = next(c for c in hs.cases() if c.name == name)
    # DDP rebuilds its buckets in the second forward, with copies to the host (CUDA sees them); on a GPU it also times
    # its first ten forwards on CUDA events the host waits for, which the sync debug mode does not report
    return hs.measure(case, data, tmp_path / "run", warmup=hs.warmup_steps(device), steps=2,
                      device=torch.device(device))


# every bf16 case, and fp32 at one clip mode (the other fp32 cases run the same code as bf16 without the casts)
SYNC_FREE = [c.name for c in hs.cases() if "fp16" not in c.name and (" bf16 " in c.name or "clip=after" in c.name)]


@pytest.mark.parametrize("name", SYNC_FREE)
def test_fp32_and_bf16_steps_never_sync_and_train_syncs_only_to_print(data, tmp_path, name):
    row = measure(data, tmp_path, name)
    assert row["per_step"] == 0, row["where"]
    assert row["per_interval"] == 1, row["where_train"]  # the progress line's loss
    assert all(where.startswith("bert/train/faults.py:") for line in row["where_train"]  # mean_over_ranks
               for where in [line.rsplit(" at ", 1)[1]])


FP16_ON_DEVICE = [  # the overflow skip decided on the device: torch's fused AdamW in its kernel, master weights
    "adam fp16 clip=bucket",  # (LAMB with its count on the device, fused AdamW) in the update (bert.optim.master)
    "lamb fp16 master clip=bucket", "adam fp16 master clip=after", "lamb fp16 master clip=after",
    "lamb fp16 master, 2 micro-steps", "lamb fp16 master, balanced buffers",
    "lamb fp16 master, OPTIMIZER_SHARDING=1",  # the ranks' flags agreed on the device (AgreedGradScaler)
]


@pytest.mark.parametrize("name", FP16_ON_DEVICE)
def test_fp16_steps_skip_an_overflow_without_a_sync(data, tmp_path, name):
    row = measure(data, tmp_path, name)
    assert row["per_step"] == 0, row["where"]
    assert row["per_interval"] == 2, row["where_train"]  # the progress line's loss and loss scale


def test_fp16_lamb_without_master_weights_syncs_once_to_skip_an_overflowed_step(data, tmp_path):
    """GradScaler.step reads found_inf on the host before an optimizer that takes no found_inf (the A100 configs'
    autocast path; their MASTER_WEIGHTS=1 path has no sync)."""
    row = measure(data, tmp_path, "lamb fp16 clip=after")
    assert row["per_step"] == 1 and row["where"][0].split(" at ")[1].startswith("bert/train/loop.py:"), row["where"]
    assert row["per_interval"] == hs.LOG_FREQ + 2, row["where_train"]  # a check per step; loss, loss scale


def test_a_sync_slipped_into_the_step_is_found_and_named(data, tmp_path, monkeypatch):
    from bert.dist.clip import Clipper

    before_step = Clipper.before_step

    def reading(self, optimizer, scaler):
        before_step(self, optimizer, scaler)
        if bool(optimizer.param_groups[0]["params"][0].grad.isfinite().all()):
            pass

    monkeypatch.setattr(Clipper, "before_step", reading)
    row = measure(data, tmp_path, "lamb bf16 master clip=after")
    assert row["per_step"] == 1 and row["where"] == [f"2 x _local_scalar_dense at tests/test_host_syncs.py:"
                                                     f"{reading.__code__.co_firstlineno + 2}"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["lamb bf16 master clip=after", "lamb bf16 clip=after", "adam bf16 master clip=bucket",
                                  "lamb bf16 master, STATIC_TOKENS=128", "lamb fp16 master clip=after",
                                  "adam fp16 master clip=after"])
def test_cuda_step_makes_no_synchronizing_cuda_call(data, tmp_path, name):
    """torch's own detector on the GPU, flash varlen attention: it also sees copies to the host."""
    row = measure(data, tmp_path, name, "cuda")
    assert row["per_step"] == 0 and row["cuda_per_step"] == 0, row["cuda_where"]
