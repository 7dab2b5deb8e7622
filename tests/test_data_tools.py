"""The dataset scripts' parts, in-process and on a few samples: shard chopping, the eval pick, the text parts'
eval hold-out and dealing, data/verify.py's per-sample checks and NVIDIA content checksums, the fixed -> varlength
conversion (block by block) and its CLI's refusals, and the length sidecar for shards without `lengths`.
(tests/test_prepare_cli.py runs the whole pipeline through the command line, tests/test_data_reference.py the
reference pipeline.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from bert.data.format import (
    FixedShard,
    ShardError,
    VarlenShard,
    fixed_slices_to_varlength,
    fixed_to_varlength,
    write_fixed_shard,
    write_varlength_shard,
)
from bert.data.index import LengthIndex
from bert.sample import Sample

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))

import convert_fixed2varlength  # noqa: E402
import hdf5_content_md5  # noqa: E402
import index_lengths  # noqa: E402
import verify  # noqa: E402
from shard_split import Piece, plan_shards, write_eval_set, write_shard  # noqa: E402
from text_parts import _is_eval, write_text_parts  # noqa: E402
from verify import check_shard  # noqa: E402
from wordpiece import default_vocab_path, load_vocab  # noqa: E402


def tagged(g: int, length: int = 6) -> Sample:
    """[CLS] w w .. [SEP] with every word 2000 + g, position 1 masked: the sample says which one it is."""
    ids = np.full(length, 2000 + g)
    ids[0], ids[-1] = 101, 102
    return Sample(ids, (np.arange(length) >= length // 2).astype(np.int64), np.array([1]), np.array([2000 + g]), g % 2)


def tags(samples) -> list[int]:
    return [int(s.input_ids[1]) - 2000 for s in samples]


def test_plan_shards_cuts_the_parts_read_back_to_back_into_near_equal_shards(tmp_path):
    parts = [Path("a"), Path("b"), Path("c")]
    jobs = plan_shards(parts, [5, 3, 4], 5, tmp_path)  # 12 rows: shards of 2 2 3 2 3 (rows k*12//5 ..)
    assert [job.dst.name for job in jobs] == [f"part_{k:05d}_of_00005.hdf5" for k in range(5)]
    assert [job.pieces for job in jobs] == [
        (Piece(parts[0], 0, 2),),
        (Piece(parts[0], 2, 4),),
        (Piece(parts[0], 4, 5), Piece(parts[1], 0, 2)),
        (Piece(parts[1], 2, 3), Piece(parts[2], 0, 1)),
        (Piece(parts[2], 1, 4),),
    ]
    with pytest.raises(ValueError, match="cannot cut 12 samples into 13 shards"):
        plan_shards(parts, [5, 3, 4], 13, tmp_path)


def test_written_shards_hold_every_row_once_in_order(tmp_path):
    counts, g = [7, 1, 5], 0
    parts = []
    for p, n in enumerate(counts):
        parts.append(tmp_path / f"part-{p}.hdf5")
        write_fixed_shard(parts[-1], [tagged(g + i) for i in range(n)], 8, 2)
        g += n
    (tmp_path / "out").mkdir()
    jobs = plan_shards(parts, counts, 4, tmp_path / "out")
    assert [write_shard(job) for job in jobs] == [3, 3, 3, 4]
    rows = []
    for job in jobs:
        with VarlenShard(job.dst) as shard:
            rows += tags(shard)
    assert rows == list(range(13))


def test_eval_set_is_a_sorted_pick_without_repeats(tmp_path):
    write_fixed_shard(tmp_path / "eval.hdf5", [tagged(g) for g in range(30)], 8, 2)
    dst = write_eval_set(tmp_path / "eval.hdf5", tmp_path, 20, seed=3)
    assert dst.name == "part_eval_20.hdf5"
    with VarlenShard(dst) as picked:
        got = tags(picked)
    assert len(got) == 20 and len(set(got)) == 20 and got == sorted(got) and set(got) <= set(range(30))
    (tmp_path / "all").mkdir()
    everything = write_eval_set(tmp_path / "eval.hdf5", tmp_path / "all", 50, seed=3)  # fewer than wanted: all
    assert everything.name == "part_eval_30.hdf5"
    with VarlenShard(everything) as picked:
        assert tags(picked) == list(range(30))


def test_eval_documents_are_evenly_spaced_from_the_first(tmp_path):
    assert [i for i in range(12) if _is_eval(i, 0.25)] == [0, 4, 8]
    assert [i for i in range(6) if _is_eval(i, 0.5)] == [0, 2, 4]
    docs = [(f"Document number {k}.", 1) for k in range(9)]
    counts = write_text_parts(docs, tmp_path / "text", 2, 0.25, workers=1)
    assert counts == {"documents": 9, "eval_documents": 3, "sentences": 9}

    def numbers(name: str) -> list[int]:
        return [int(line.split()[-1][:-1]) for line in (tmp_path / "text" / name).read_text().split("\n") if line]

    # The rest are dealt round robin over the parts: 1 2 3 5 6 7 -> part 0 gets 1 3 6, part 1 gets 2 5 7.
    assert numbers("eval.txt") == [0, 4, 8]
    assert numbers("part-00000.txt") == [1, 3, 6] and numbers("part-00001.txt") == [2, 5, 7]


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(default_vocab_path())  # [CLS] 101, [SEP] 102, 30522 entries


GOOD = Sample(np.array([101, 2000, 2001, 102, 2002, 102]), np.array([0, 0, 0, 0, 1, 1]), np.array([1, 4]),
              np.array([2000, 2002]), 0)


POSITIONS = "has masked positions that are unsorted or on [CLS]/[SEP]"
OUTSIDE = "has token ids outside {vocab} (30522 entries)"
FRAMING = "is not [CLS] ... [SEP] in {vocab}; built with another vocab?"


@pytest.mark.parametrize("bad, problem", [
    (GOOD._replace(masked_positions=np.array([1, 5])), POSITIONS),  # the last [SEP]
    (GOOD._replace(masked_positions=np.array([0, 4])), POSITIONS),  # [CLS]
    (GOOD._replace(masked_positions=np.array([4, 4])), POSITIONS),  # twice the same
    (GOOD._replace(masked_positions=np.array([4, 1])), POSITIONS),
    (GOOD._replace(masked_labels=np.array([2000, 30522])), OUTSIDE),  # a label one past the vocab
    (GOOD._replace(input_ids=np.array([101, 2000, 30522, 102, 2002, 102])), OUTSIDE),
    (GOOD._replace(input_ids=np.array([101, 2000, 2001, 102, 2002, 2003])), FRAMING),
])
def test_verify_names_the_bad_sample(tmp_path, vocab, bad, problem):
    path = tmp_path / "shard.hdf5"
    write_varlength_shard(path, [GOOD, GOOD])
    assert check_shard((path, vocab)) == []
    write_varlength_shard(path, [GOOD, bad, GOOD])
    assert check_shard((path, vocab)) == [f"{path}: sample 1 " + problem.format(vocab=vocab.path)]


def test_fixed_to_varlength_cli(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert convert_fixed2varlength.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'empty'}: no *.hdf5 shards" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "src").mkdir()
    write_fixed_shard(tmp_path / "src" / "part-0.hdf5", [tagged(g) for g in range(5)], 8, 2)
    assert convert_fixed2varlength.main([str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1"]) == 0
    with VarlenShard(tmp_path / "out" / "part-0.hdf5") as shard, FixedShard(tmp_path / "src" / "part-0.hdf5") as src:
        assert tags(shard) == tags(src) == list(range(5))
    assert (tmp_path / "out" / "checksums.md5").read_text().endswith("  part-0.hdf5\n")


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_conversion_block_by_block_writes_the_bytes_of_a_whole_conversion(tmp_path):
    samples = [tagged(g, length=3 + g % 5) for g in range(23)]  # equal-length rows within a block too
    write_fixed_shard(tmp_path / "a.hdf5", samples[:10], 8, 2)
    write_fixed_shard(tmp_path / "b.hdf5", samples[10:], 8, 2)
    write_varlength_shard(tmp_path / "whole.hdf5", samples[:10])  # what fixed_to_varlength wrote before: one list
    assert fixed_to_varlength(tmp_path / "a.hdf5", tmp_path / "blocks.hdf5", block=3) == 10
    assert _md5(tmp_path / "blocks.hdf5") == _md5(tmp_path / "whole.hdf5")
    write_varlength_shard(tmp_path / "whole.hdf5", samples[4:17])
    slices = [(tmp_path / "a.hdf5", 4, None), (tmp_path / "b.hdf5", 0, 7)]
    assert fixed_slices_to_varlength(tmp_path / "blocks.hdf5", slices, block=2) == 13  # blocks across the two parts
    assert _md5(tmp_path / "blocks.hdf5") == _md5(tmp_path / "whole.hdf5")


def nvidia_md5(path: Path) -> str:
    """NVIDIA's hdf5_md5.py, as its algorithm reads: md5 of str() of the list of md5(str(row.tolist())) per row."""
    with h5py.File(path, "r") as f:
        rows = [hashlib.md5(str(f["input_ids"][i].tolist()).encode("utf-8")).hexdigest()
                for i in range(f["input_ids"].shape[0])]
    return hashlib.md5(str(rows).encode("utf-8")).hexdigest()


def test_content_md5_is_nvidias_for_varlength_and_fixed_files(tmp_path, monkeypatch):
    monkeypatch.setattr(hdf5_content_md5, "ROWS_PER_READ", 4)  # several reads
    samples = [tagged(g, length=4 + g % 3) for g in range(11)]
    write_varlength_shard(tmp_path / "v.hdf5", samples)
    write_fixed_shard(tmp_path / "f.hdf5", samples, 8, 2)
    for path in (tmp_path / "v.hdf5", tmp_path / "f.hdf5"):
        assert hdf5_content_md5.content_md5(path) == nvidia_md5(path)
    assert nvidia_md5(tmp_path / "v.hdf5") != nvidia_md5(tmp_path / "f.hdf5")  # padding is part of a fixed row
    write_varlength_shard(tmp_path / "w.hdf5", samples[:10] + [tagged(99, length=6)])  # one row differs
    assert hdf5_content_md5.content_md5(tmp_path / "w.hdf5") != nvidia_md5(tmp_path / "v.hdf5")


def test_verify_checks_nvidia_lists_without_our_checksums(tmp_path, capsys):
    data = tmp_path / "hdf5"
    (data / "train").mkdir(parents=True)
    (data / "eval").mkdir()
    for k in range(3):
        write_varlength_shard(data / "train" / f"part_{k:05d}_of_00003.hdf5", [tagged(10 * k + i) for i in range(4)])
    write_varlength_shard(data / "eval" / "part_eval_10k.hdf5", [tagged(i) for i in range(5)])
    train_chk, eval_chk = tmp_path / "train.chk", tmp_path / "eval.chk"
    assert hdf5_content_md5.main([str(data / "train"), "--out", str(train_chk), "--workers", "1"]) == 0
    assert hdf5_content_md5.main([str(data / "eval"), "--out", str(eval_chk), "--workers", "1"]) == 0
    assert eval_chk.read_text() == f"part_eval_10k.hdf5\t{nvidia_md5(data / 'eval' / 'part_eval_10k.hdf5')}\n"
    capsys.readouterr()
    assert hdf5_content_md5.main([str(data / "train"), "--workers", "1"]) == 0  # without --out: the list printed
    assert capsys.readouterr().out == train_chk.read_text()
    args = [str(data), "--chk", str(train_chk), "--chk", str(eval_chk), "--workers", "1"]
    assert verify.main(args) == 0  # no checksums.md5 under data/: not needed with --chk alone
    assert capsys.readouterr().out.splitlines() == [f"{data}: OK, 3 files match {train_chk}",
                                                    f"{data}: OK, 1 files match {eval_chk}"]
    write_varlength_shard(data / "train" / "part_00001_of_00003.hdf5", [tagged(10 + i) for i in (0, 1, 3, 2)])
    (data / "train" / "part_00002_of_00003.hdf5").unlink()
    assert verify.main(args) == 1
    err = capsys.readouterr().err
    assert f"{data / 'train' / 'part_00001_of_00003.hdf5'}: content md5 " in err and f"in {train_chk.name}" in err
    assert f"{data}: part_00002_of_00003.hdf5 (listed in {train_chk}) is missing" in err
    assert f"{data}: 2 problem(s) in 3 listed files" in err
    assert verify.main([str(data), "--workers", "1"]) == 1  # without --chk, checksums.md5 is required as before
    assert "checksums.md5: no checksum list" in capsys.readouterr().err


def _nvidia_shard(path: Path, samples: list[Sample]) -> None:
    """A varlength shard as NVIDIA's converter writes it: no `lengths`."""
    write_varlength_shard(path, samples)
    with h5py.File(path, "a") as f:
        del f["lengths"]


def test_length_sidecar_replaces_reading_input_ids(tmp_path, capsys):
    _nvidia_shard(tmp_path / "part_0.hdf5", [tagged(g, length=3 + g) for g in range(5)])
    _nvidia_shard(tmp_path / "part_1.hdf5", [tagged(g, length=40) for g in range(3)])
    write_varlength_shard(tmp_path / "part_2.hdf5", [tagged(g, length=7) for g in range(2)])  # stores its lengths
    scanned = LengthIndex.scan(tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        f"{tmp_path}: 2 of 3 shards store no lengths, so their input_ids were read to find them (on every rank); "
        f"python data/index_lengths.py {tmp_path} writes them once"]
    assert index_lengths.main([str(tmp_path), "--workers", "1"]) == 0
    with np.load(tmp_path / "lengths.npz") as sidecar:
        assert sorted(sidecar.files) == ["part_0.hdf5", "part_0.hdf5:stat", "part_1.hdf5", "part_1.hdf5:stat"]
        assert sidecar["part_1.hdf5"].dtype == np.int16
        stat = (tmp_path / "part_1.hdf5").stat()
        assert sidecar["part_1.hdf5:stat"].tolist() == [stat.st_size, int(stat.st_mtime)]
    capsys.readouterr()
    indexed = LengthIndex.scan(tmp_path)
    assert capsys.readouterr().err == ""
    assert indexed.paths == scanned.paths and [p.name for p in indexed.paths] == [f"part_{k}.hdf5" for k in range(3)]
    assert np.array_equal(indexed.offsets, scanned.offsets) and np.array_equal(indexed.lengths, scanned.lengths)
    assert indexed.lengths.tolist() == [3, 4, 5, 6, 7, 40, 40, 40, 7, 7]
    _nvidia_shard(tmp_path / "part_1.hdf5", [tagged(g, length=40) for g in range(4)])  # rewritten: a row more
    with pytest.raises(ShardError, match=f"^{tmp_path / 'part_1.hdf5'}: 4 samples .*, but "
                                         f"{tmp_path / 'lengths.npz'} lists 3 lengths for it"):
        LengthIndex.scan(tmp_path)
    # as many rows, other lengths, and the same size in bytes (HDF5 pads its heaps): only the time tells
    _nvidia_shard(tmp_path / "part_1.hdf5", [tagged(g, length=39) for g in range(3)])
    listed = (tmp_path / "part_1.hdf5").stat()
    os.utime(tmp_path / "part_1.hdf5", (listed.st_atime, listed.st_mtime + 5))
    with pytest.raises(ShardError, match=r"3 samples \(bytes, mtime .*\), but .* lists 3 lengths for it .* rerun"):
        LengthIndex.scan(tmp_path)
    write_varlength_shard(tmp_path / "part_1.hdf5", [tagged(g, length=39) for g in range(3)])  # now stores lengths
    assert LengthIndex.scan(tmp_path).lengths.tolist() == [3, 4, 5, 6, 7, 39, 39, 39, 7, 7]  # its own come first
    _nvidia_shard(tmp_path / "part_1.hdf5", [tagged(g, length=40) for g in range(3)])
    assert index_lengths.main([str(tmp_path), "--workers", "1"]) == 0
    with np.load(tmp_path / "lengths.npz") as sidecar:  # a sidecar without the times: the row count still tells
        bare = {name: sidecar[name] for name in sidecar.files if not name.endswith(":stat")}
    with (tmp_path / "lengths.npz").open("wb") as f:
        np.savez(f, **bare)
    _nvidia_shard(tmp_path / "part_1.hdf5", [tagged(g, length=40) for g in range(4)])
    with pytest.raises(ShardError, match="4 samples .* lists 3 lengths for it"):
        LengthIndex.scan(tmp_path)


# Blocks `import torch` in the process it runs in: whatever asks for it fails naming it.
NO_TORCH = """
import importlib.abc, runpy, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} imported by a data tool")
sys.meta_path.insert(0, NoTorch())
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/data"]
for module in sys.argv[3].split(","):
    __import__(module)
sys.argv = sys.argv[2:3] + sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def no_torch(tool: str, preload: str, *args: str) -> subprocess.CompletedProcess:
    """`tool` run with `args` after importing `preload` (comma-separated modules), with torch blocked."""
    return subprocess.run([sys.executable, "-c", NO_TORCH, str(ROOT), tool, preload, *args], capture_output=True,
                          text=True)


def test_the_data_tools_start_and_write_shards_without_torch(tmp_path):
    """The data tools read and write shards and never train: each started process imports no torch (about 2 s of
    CPU each, and the suite starts dozens). One writes a whole data set with torch blocked."""
    synthetic = str(ROOT / "data" / "make_synthetic_dataset.py")
    tools = "prepare,shard_split,convert_fixed2varlength,make_random_shards,verify,index_lengths,bert.data.reader"
    out = no_torch(synthetic, tools, "--out", str(tmp_path), "--train-samples", "64", "--eval-samples", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert sum(len(VarlenShard(f)) for f in (tmp_path / "train_varlength").glob("*.hdf5")) == 64
    assert "torch imported by a data tool" in no_torch(synthetic, "bert.batch", "--help").stderr  # the guard bites
