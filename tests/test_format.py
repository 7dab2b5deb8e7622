import pickle

import h5py
import numpy as np
import pytest

from bert.batch import Sample
from bert.data.format import (
    FixedShard,
    ShardError,
    VarlenShard,
    fixed_to_varlength,
    write_fixed_shard,
    write_varlength_shard,
)
from bert.synthetic import random_sample

# NVIDIA's varlength layout, typed out independently of bert.data.format.
NVIDIA_VLEN = {
    "input_ids": np.int16,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16,
}


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [random_sample(int(length), rng) for length in rng.integers(1, 513, size=n)]


def _assert_same(got: list[Sample], want: list[Sample]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for field in ("input_ids", "segment_ids", "masked_positions", "masked_labels"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert a.nsp_label == b.nsp_label


def _nvidia_shard(path, samples: list[Sample]) -> None:
    """A shard as NVIDIA's converter writes it: no length index."""
    with h5py.File(path, "w") as f:
        fields = {"input_ids": 0, "segment_ids": 1, "masked_lm_positions": 2, "masked_lm_ids": 3}
        for key, dtype in NVIDIA_VLEN.items():
            ds = f.create_dataset(key, (len(samples),), dtype=h5py.vlen_dtype(dtype))
            for i, s in enumerate(samples):
                ds[i] = np.asarray(s[fields[key]], dtype=dtype)
        f.create_dataset("next_sentence_labels", data=np.array([s.nsp_label for s in samples], np.int8))


def test_varlength_round_trip_and_exact_nvidia_dtypes(tmp_path):
    samples = _samples(300)
    path = tmp_path / "v.hdf5"
    assert write_varlength_shard(path, samples) == 300
    with h5py.File(path, "r") as f:
        for key, dtype in NVIDIA_VLEN.items():
            assert h5py.check_vlen_dtype(f[key].dtype) == np.dtype(dtype) and f[key].shape == (300,)
        assert f["next_sentence_labels"].dtype == np.int8
        assert f["lengths"][()].tolist() == [len(s.input_ids) for s in samples]
    with VarlenShard(path) as shard:
        assert len(shard) == 300
        assert shard.lengths().tolist() == [len(s.input_ids) for s in samples]
        _assert_same(list(shard), samples)
        order = [299, 3, 3, 0, 150]
        _assert_same(shard.read(order), [samples[i] for i in order])
        _assert_same([shard[-1]], [samples[-1]])
        with pytest.raises(IndexError):
            shard[300]


def test_fixed_round_trip_padding_and_conversion(tmp_path, monkeypatch):
    monkeypatch.setattr("bert.data.format.FIXED_BLOCK", 64)  # several padded blocks, the last one partial
    samples = _samples(200, seed=1)
    fixed, varlen = tmp_path / "f.hdf5", tmp_path / "v.hdf5"
    write_fixed_shard(fixed, samples)
    with h5py.File(fixed, "r") as f:
        assert f["input_ids"].shape == (200, 512) and f["masked_lm_ids"].shape == (200, 76)
        lengths = np.array([len(s.input_ids) for s in samples])
        assert np.array_equal(f["input_mask"][()].sum(1), lengths)
        assert not f["input_ids"][()][np.arange(512) >= lengths[:, None]].any()  # zero padding
    with FixedShard(fixed) as shard:
        _assert_same(list(shard), samples)
    assert fixed_to_varlength(fixed, varlen) == 200
    with VarlenShard(varlen) as shard:
        _assert_same(list(shard), samples)


def test_nvidia_shard_without_length_index_loads(tmp_path):
    samples = _samples(50, seed=2)
    _nvidia_shard(tmp_path / "nv.hdf5", samples)
    with VarlenShard(tmp_path / "nv.hdf5") as shard:
        assert shard.lengths().tolist() == [len(s.input_ids) for s in samples]
        _assert_same(list(shard), samples)


def test_shard_reopens_after_pickling(tmp_path):
    write_varlength_shard(tmp_path / "v.hdf5", _samples(5))
    shard = pickle.loads(pickle.dumps(VarlenShard(tmp_path / "v.hdf5")))
    assert len(shard) == 5


def _damaged(tmp_path, how: str):
    path = tmp_path / f"{how}.hdf5"
    samples = _samples(20, seed=3)
    if how == "truncated":
        write_varlength_shard(path, samples)
        path.write_bytes(path.read_bytes()[:3000])
    elif how == "not_hdf5":
        path.write_bytes(b"hello" * 100)
    else:
        _nvidia_shard(path, samples)
        with h5py.File(path, "a") as f:
            if how == "missing_key":
                del f["masked_lm_ids"]
            elif how == "wrong_dtype":
                del f["segment_ids"]
                f.create_dataset("segment_ids", (20,), dtype=h5py.vlen_dtype(np.int32))
            elif how == "uneven_rows":
                del f["next_sentence_labels"]
                f.create_dataset("next_sentence_labels", data=np.zeros(19, np.int8))
            elif how == "wrong_nsp_dtype":
                del f["next_sentence_labels"]
                f.create_dataset("next_sentence_labels", data=np.zeros(20, np.int32))
            elif how == "uneven_length_index":  # the optional length index, one row short
                f.create_dataset("lengths", data=np.array([len(s.input_ids) for s in samples[:19]], np.int16))
            elif how == "wrong_length_index_dtype":
                f.create_dataset("lengths", data=np.array([len(s.input_ids) for s in samples], np.int32))
    return path


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "truncated or corrupt"),
        ("not_hdf5", "truncated or corrupt"),
        ("missing_key", "missing key 'masked_lm_ids'"),
        ("wrong_dtype", "'segment_ids' is vlen int32"),
        ("uneven_rows", "disagree on the number of samples"),
        ("wrong_nsp_dtype", "'next_sentence_labels' is int32, expected int8"),
        ("uneven_length_index", "disagree on the number of samples"),
        ("wrong_length_index_dtype", "'lengths' is int32, expected int16"),
    ],
)
def test_bad_shards_raise_naming_the_file(tmp_path, how, message):
    path = _damaged(tmp_path, how)
    with pytest.raises(ShardError, match=message) as err:
        VarlenShard(path)
    assert str(path) in str(err.value)


def test_failed_write_leaves_nothing(tmp_path):
    bad = Sample(np.array([101, 40000, 102]), np.zeros(3), np.array([1]), np.array([40000]), 0)
    with pytest.raises(ValueError, match="outside int16"):
        write_varlength_shard(tmp_path / "v.hdf5", _samples(3) + [bad])
    assert list(tmp_path.iterdir()) == []


def test_equal_length_rows_and_empty_masks_survive(tmp_path):
    # equal lengths must not collapse into a 2-d array; a lone [CLS] has nothing masked
    samples = [
        Sample(np.array([101, 7, 102]), np.array([0, 0, 1]), np.array([1]), np.array([7]), i % 2) for i in range(4)
    ]
    samples.append(Sample(np.array([101]), np.array([0]), np.zeros(0, np.int64), np.zeros(0, np.int64), 0))
    write_varlength_shard(tmp_path / "v.hdf5", samples)
    write_fixed_shard(tmp_path / "f.hdf5", samples)
    with VarlenShard(tmp_path / "v.hdf5") as varlen, FixedShard(tmp_path / "f.hdf5") as fixed:
        _assert_same(list(varlen), samples)
        _assert_same(list(fixed), samples)
    assert write_varlength_shard(tmp_path / "empty.hdf5", []) == 0
    with VarlenShard(tmp_path / "empty.hdf5") as empty:
        assert len(empty) == 0 and empty.lengths().shape == (0,) and empty.read([]) == []


def test_conversion_names_the_source_of_ids_beyond_int16(tmp_path):
    bad = Sample(np.array([101, 40000, 102]), np.zeros(3), np.array([1]), np.array([40000]), 0)
    write_fixed_shard(tmp_path / "f.hdf5", [bad])
    with pytest.raises(ShardError, match=f"{tmp_path / 'f.hdf5'}: cannot convert.*outside int16"):
        fixed_to_varlength(tmp_path / "f.hdf5", tmp_path / "v.hdf5")
    assert not (tmp_path / "v.hdf5").exists()
