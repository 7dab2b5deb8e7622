"""data/phase1_heads.py: heads fitted on a frozen encoder's cached features; the file loads with all its heads."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bert.batch import Sample, collate
from bert.data.format import write_varlength_shard
from bert.model.checkpoint import save_weights
from bert.model.config import NAMED
from bert.model.init_checkpoint import load_init_checkpoint
from bert.model.pretraining import BertForPreTraining

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import phase1_heads  # noqa: E402


def samples(n: int, seed: int = 0) -> list[Sample]:
    # Labels from 12 token ids, NSP tied to the first token: a signal the heads can learn in a few steps.
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(8, 24))
        ids = rng.integers(1000, 1100, length)
        nsp = int(ids[1] % 2)
        pos = np.sort(rng.choice(np.arange(1, length), 3, replace=False))
        segment = (np.arange(length) >= length // 2).astype(np.int64)
        out.append(Sample(ids, segment, pos, rng.integers(2000, 2012, 3), nsp))
    return out


@pytest.fixture(scope="module")
def built() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(NAMED["tiny"], attention="padded")


@pytest.fixture
def model(built) -> BertForPreTraining:
    return copy.deepcopy(built)  # building initialises a 30k-row embedding: once per file


def test_cached_features_give_the_full_models_losses(model):
    """encode + the heads on its rows = the whole model's forward (eval mode): nothing lost in the cache."""
    data = samples(10)
    mlm, nsp, acc = phase1_heads.head_losses(model, phase1_heads.encode(model, data, batch_size=4))
    with torch.no_grad():
        ref = model(collate(data))
    torch.testing.assert_close(mlm, ref.mlm_loss)
    torch.testing.assert_close(nsp, ref.nsp_loss)
    assert float(acc) == float(ref.mlm_correct) / float(ref.mlm_total)


def test_fit_changes_the_heads_only_and_lowers_the_loss(model):
    before = {n: t.clone() for n, t in model.state_dict().items()}
    features = phase1_heads.encode(model, samples(40))
    losses = phase1_heads.fit_heads(model, features, steps=20, lr=0.1, tokens=64)
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])
    after = model.state_dict()
    heads = {n for n in after if n.startswith(phase1_heads.HEADS)}
    assert heads == {"cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
                     "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
                     "cls.predictions.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    for name, t in after.items():
        assert torch.equal(t, before[name]) != (name in heads), name  # heads moved, the rest did not
    assert all(p.requires_grad for p in model.parameters())  # handed back trainable for phase 2


def test_written_checkpoint_loads_with_its_heads(model, tmp_path):
    (tmp_path / "train_varlength").mkdir()
    for i in range(2):
        write_varlength_shard(tmp_path / "train_varlength" / f"part_{i:05d}_of_00002.hdf5", samples(20, seed=i))
    save_weights(model, tmp_path / "encoder.safetensors")
    assert phase1_heads.main(["--data", str(tmp_path), "--encoder", str(tmp_path / "encoder.safetensors"),
                              "--config", "tiny", "--samples", "30", "--shards", "2", "--steps", "5",
                              "--tokens", "32"]) == 0
    out = tmp_path / phase1_heads.OUTPUT
    fresh = copy.deepcopy(model)
    for t in fresh.state_dict().values():
        t.zero_()  # every tensor must come from the file
    loaded = load_init_checkpoint(fresh, str(out))
    assert loaded.fresh_heads == [] and "cls.seq_relationship.weight" in loaded.loaded
    for name, t in fresh.state_dict().items():
        same = torch.equal(t, model.state_dict()[name])
        assert same != name.startswith(phase1_heads.HEADS), name  # the encoder's weights, new heads


def test_split_holds_out_the_last_fraction_of_each_kind_of_row():
    """20 masked rows and 10 pooled rows, 10 % held out: fit on the first 18 and 9, hold out the last 2 and 1
    (by hand); every row lands on exactly one side."""
    f = phase1_heads.Features(torch.arange(20.0).unsqueeze(1), torch.arange(20), torch.arange(10.0).unsqueeze(1),
                              torch.arange(10))
    fit, held = f.split(0.1)
    assert fit.masked_labels.tolist() == list(range(18)) and held.masked_labels.tolist() == [18, 19]
    assert fit.masked[:, 0].tolist() == list(range(18)) and held.masked[:, 0].tolist() == [18.0, 19.0]
    assert fit.nsp_labels.tolist() == list(range(9)) and held.nsp_labels.tolist() == [9]
    assert fit.pooled[:, 0].tolist() == list(range(9)) and held.pooled[:, 0].tolist() == [9.0]


def test_first_samples_takes_the_first_of_each_shard_rounding_up(tmp_path):
    """5 samples from 2 shards: ceil(5 / 2) = 3 from each, the first 5 of those kept (3 + 2); 4 from 3 shards: 2
    from each, the first 4 kept (2 + 2)."""
    shards = [samples(6, seed=i) for i in range(3)]
    for i, shard in enumerate(shards):
        write_varlength_shard(tmp_path / f"part_{i:05d}_of_00003.hdf5", shard)
    ids = lambda got: [s.input_ids.tolist() for s in got]  # noqa: E731
    want = [shards[0][0], shards[0][1], shards[0][2], shards[1][0], shards[1][1]]
    assert ids(phase1_heads.first_samples(tmp_path, 5, 2)) == ids(want)
    want = [shards[0][0], shards[0][1], shards[1][0], shards[1][1]]
    assert ids(phase1_heads.first_samples(tmp_path, 4, 3)) == ids(want)
