"""Samples against what the model takes (bert.data.limits): each kind of bad value is found in the sample a
per-sample reference finds it in, and the loader and the eval set name its shard and row, from id shards whose
samples carry their global id (so the shard and row are known independently of the index)."""

import re

import numpy as np
import pytest
from multiproc.id_shards import ID_BASE, id_sample, write_id_shards

from bert.batch import Sample, collate
from bert.data.format import ShardError
from bert.data.index import LengthIndex
from bert.data.limits import SampleLimits
from bert.data.pipeline import EvalSet, TrainLoader

LIMITS = SampleLimits(vocab_size=ID_BASE + 40, type_vocab_size=2, max_length=64)
FIELDS = ("token id", "segment id", "masked label", "next-sentence label")  # lengths: the index (below)


def spoiled(sample: Sample, field: str, rng: np.random.Generator) -> Sample:
    """`sample` with one value outside LIMITS, in `field`, at a random place."""
    ids, seg, pos, lab = (a.copy() for a in (sample.input_ids, sample.segment_ids, sample.masked_positions,
                                             sample.masked_labels))
    nsp = sample.nsp_label
    if field == "token id":
        ids[rng.integers(len(ids))] = rng.choice([-1, LIMITS.vocab_size, 32000])
    elif field == "segment id":
        seg[rng.integers(len(seg))] = rng.choice([-1, 2, 7])
    elif field == "masked label":
        lab[rng.integers(len(lab))] = rng.choice([-5, LIMITS.vocab_size])
    else:
        nsp = int(rng.choice([-1, 2]))
    return Sample(ids, seg, pos, lab, nsp)


def reference(samples: list[Sample]) -> tuple[int, str] | None:
    """The first field (in the checker's order) any sample breaks, and the first sample that breaks it."""
    def outside(values, limit):
        return bool(((np.asarray(values) < 0) | (np.asarray(values) >= limit)).any())

    tests = {"token id": lambda s: outside(s.input_ids, LIMITS.vocab_size),
             "segment id": lambda s: outside(s.segment_ids, LIMITS.type_vocab_size),
             "masked label": lambda s: outside(s.masked_labels, LIMITS.vocab_size),
             "next-sentence label": lambda s: s.nsp_label not in (0, 1)}
    for field in FIELDS:
        bad = [i for i, s in enumerate(samples) if tests[field](s)]
        if bad:
            return bad[0], field
    return None


def test_violations_are_found_in_the_sample_a_per_sample_reference_finds_them_in():
    rng = np.random.default_rng(0)
    for trial in range(300):
        samples = [id_sample(int(g), int(n)) for g, n in zip(rng.integers(0, 40, 8), rng.integers(3, 65, 8))]
        for i in rng.choice(8, size=rng.integers(0, 3), replace=False):
            samples[i] = spoiled(samples[i], FIELDS[rng.integers(len(FIELDS))], rng)
        want, got = reference(samples), LIMITS.violation(collate(samples))
        if want is None:
            assert got is None, trial
        else:
            assert got is not None and got[0] == want[0], (trial, want, got)
            assert want[1] in got[1], (trial, want, got)


def test_loader_names_the_shard_and_row_of_the_first_sample_beyond_the_vocabulary(tmp_path):
    paths = write_id_shards(tmp_path, [[20] * 25, [30] * 25])  # samples 0..49, token ids ID_BASE + g
    for seed, vocab in ((0, 41), (1, 45), (2, 30), (3, 48)):  # samples g >= vocab - ID_BASE are bad
        limits = SampleLimits(ID_BASE + vocab, 2, 64)
        loader = TrainLoader(tmp_path, 16, 1, 0, 1, seed=seed, shuffle_buffer=50, limits=limits, prefetch=1)
        step = next(t for t in range(4) if (loader.plan.rank_ids(t, 0) >= vocab).any())
        for _ in range(step):
            next(loader)
        ids = loader.plan.rank_ids(step, 0)
        first = int(ids[np.argmax(ids >= vocab)])  # the first bad sample in the batch's order
        with pytest.raises(ShardError) as err:
            next(loader)
        shard, row = divmod(first, 25)
        assert str(err.value) == (f"{paths[shard]}: sample {row}: token id {ID_BASE + first} is outside the "
                                  f"model's 0..{ID_BASE + vocab - 1}"), seed
        loader.close()


def test_lengths_are_checked_from_the_index_before_any_sample_is_read(tmp_path):
    paths = write_id_shards(tmp_path, [[10, 64, 12], [65, 9]])
    with pytest.raises(ShardError, match=re.escape(f"{paths[1]}: sample 0 has 65 tokens, more than the model "
                                                   "takes (64")):
        LIMITS.check_index(LengthIndex.scan(tmp_path))
    for build in (lambda: TrainLoader(tmp_path, 2, 1, 0, 1, limits=LIMITS),
                  lambda: EvalSet(tmp_path, 2, 1, 0, 5, limits=LIMITS)):
        with pytest.raises(ShardError, match="sample 0 has 65 tokens"):
            build()
    TrainLoader(tmp_path, 2, 1, 0, 1).close()  # without limits: nothing is checked


def test_eval_set_names_the_shard_and_row_of_its_first_bad_sample(tmp_path):
    lengths = [[20] * 30, [20] * 30]
    paths = write_id_shards(tmp_path, lengths)  # masked label g: samples 40.. are beyond the vocabulary
    eval_set = EvalSet(tmp_path, 7, 2, 1, 50, limits=LIMITS)  # rank 1 of 2 takes samples 25..49
    with pytest.raises(ShardError) as err:
        list(eval_set)
    # token ids fail first (ID_BASE + g): sample 40 is shard 1, row 10
    assert str(err.value).startswith(f"{paths[1]}: sample 10: token id {ID_BASE + 40} ")
    assert list(EvalSet(tmp_path, 7, 2, 0, 50, limits=LIMITS))  # rank 0's samples 0..24 are fine
