"""data/prepare.py and data/verify.py end to end, through the command line, on a slice of the embedded corpus."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from bert.data.format import FixedShard, VarlenShard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))

from corpus_sources import GENSIM_WIKI_DUMP, package_file  # noqa: E402
from wordpiece import default_vocab_path  # noqa: E402

SLICE = ["--embedded", "--max-documents", "40", "--dupe-factor", "2", "--eval-samples", "100", "--num-shards", "3"]


def _run(script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(ROOT / "data" / script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _samples(shards) -> list:
    return [s for shard in shards for s in shard]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "out"
    result = _run("prepare.py", *SLICE, "--workers", "2", "--out", out)
    assert result.returncode == 0, result.stderr
    assert f"under {out / 'train_varlength'}" in result.stdout and "tokens/s" in result.stdout
    return out


@pytest.fixture
def copy(prepared, tmp_path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "out"))


def test_shards_hold_every_fixed_sample_once_and_the_eval_set_is_held_out(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    # copies where run.sub's containers look (they mount the shard directories alone)
    assert all(json.loads((prepared / d / "manifest.json").read_text()) == manifest
               for d in ("train_varlength", "eval_varlength"))
    shards = [VarlenShard(prepared / "train_varlength" / name) for name in manifest["train_files"]]
    sizes = [len(s) for s in shards]
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1 and sum(sizes) == manifest["train_samples"]
    parts = [FixedShard(p) for p in sorted((prepared / "fixed").glob("part-*.hdf5"))]
    train, fixed = _samples(shards), _samples(parts)
    assert len(train) == len(fixed)
    for a, b in zip(train, fixed):  # chopping keeps the order of the parts read back to back
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.masked_labels, b.masked_labels)
        assert a.nsp_label == b.nsp_label
    with VarlenShard(prepared / manifest["eval_file"]) as eval_set:
        assert len(eval_set) == manifest["eval_samples"] <= 100
    # no document feeds both the training text and the eval text
    train_text = {line for p in (prepared / "text").glob("part-*.txt") for line in p.read_text().splitlines()}
    eval_text = set((prepared / "text" / "eval.txt").read_text().splitlines()) - {""}
    assert eval_text and not eval_text & train_text


def test_checksums_agree_with_md5sum_and_verify(prepared):
    listed = (prepared / "checksums.md5").read_text().splitlines()
    assert len(listed) == 4  # 3 train shards + the eval set
    assert subprocess.run(["md5sum", "--quiet", "-c", "checksums.md5"], cwd=prepared).returncode == 0
    result = _run("verify.py", prepared)
    assert result.returncode == 0 and "OK, 4 files" in result.stdout


def test_rerun_skips_complete_outputs_and_redoes_partial_ones(copy):
    shard = copy / "train_varlength" / "part_00001_of_00003.hdf5"
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*.hdf5")}
    checksums = (copy / "checksums.md5").read_text()
    result = _run("prepare.py", *SLICE, "--out", copy)
    assert result.returncode == 0 and "were complete already" in result.stdout and "tokens/s" not in result.stdout
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*.hdf5")} == before
    # an interrupted run: a shard and a fixed part never renamed into place, temporaries left behind
    shard.unlink()
    (copy / "fixed" / "part-00003.hdf5").unlink()
    (copy / "fixed" / ".part-00003.hdf5.tmp-99999").write_bytes(b"partial")
    (shard.parent / f".{shard.name}.tmp-99999").write_bytes(b"partial")
    result = _run("prepare.py", *SLICE, "--workers", "1", "--out", copy)
    assert result.returncode == 0, result.stderr
    assert (copy / "checksums.md5").read_text() == checksums  # redone identically, whatever the worker count
    assert not list(copy.rglob(".*.tmp-*"))


def test_verify_names_each_damaged_file(copy):
    train = sorted((copy / "train_varlength").glob("*.hdf5"))
    data = bytearray(train[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    train[0].write_bytes(bytes(data))
    train[1].write_bytes(train[1].read_bytes()[:4000])  # truncated
    with h5py.File(train[2], "a") as f:
        del f["masked_lm_ids"]
    with h5py.File(next((copy / "eval_varlength").glob("*.hdf5")), "a") as f:
        del f["segment_ids"]
        f.create_dataset("segment_ids", (1,), dtype=h5py.vlen_dtype(np.int32))
    assert subprocess.run(["md5sum", "--quiet", "-c", "checksums.md5"], cwd=copy, capture_output=True).returncode
    result = _run("verify.py", copy)
    assert result.returncode == 1
    err = result.stderr
    for path in (*train, *copy.glob("eval_varlength/*.hdf5")):
        assert f"{path}: md5" in err
    assert f"{train[1]}: not a readable hdf5 file (truncated or corrupt?)" in err
    assert f"{train[2]}: missing key 'masked_lm_ids'" in err
    assert "'segment_ids' is vlen int32" in err


def test_verify_rejects_a_vocab_that_does_not_match_the_data(prepared, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(995)]]))
    result = _run("verify.py", prepared, "--vocab", vocab)
    assert result.returncode == 1 and f"token ids outside {vocab}" in result.stderr


def _text_dir(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    (directory / "a.txt").write_text(text)
    return directory


ENGLISH = "The cat sat on the mat.\nIt was a sunny day.\n\nA second document starts here.\nIt ends here.\n\n" * 20


@pytest.mark.parametrize(
    "case",
    ["empty_corpus", "no_text_files", "vocab_without_mask", "unrelated_vocab", "vocab_is_a_directory",
     "truncated_dump", "other_params"],
)
def test_bad_input_fails_naming_the_culprit(tmp_path, prepared, case):
    out = tmp_path / "out"
    vocab = tmp_path / "vocab.txt"
    if case == "empty_corpus":
        args, culprit = ["--text-dir", _text_dir(tmp_path, "\n\n   \n")], "empty corpus"
    elif case == "no_text_files":
        (tmp_path / "corpus").mkdir()
        args, culprit = ["--text-dir", tmp_path / "corpus"], f"{tmp_path / 'corpus'}: no *.txt files"
    elif case == "vocab_without_mask":
        vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n")
        args, culprit = ["--text-dir", _text_dir(tmp_path, ENGLISH), "--vocab", vocab], f"{vocab}: not a BERT"
    elif case == "unrelated_vocab":
        vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhund\nkatze\n")
        args, culprit = ["--text-dir", _text_dir(tmp_path, ENGLISH), "--vocab", vocab], f"{vocab}: 100.0% of"
    elif case == "vocab_is_a_directory":
        vocab.mkdir()
        args, culprit = ["--text-dir", _text_dir(tmp_path, ENGLISH), "--vocab", vocab], f"{vocab}: a directory, not"
    elif case == "truncated_dump":
        dump = tmp_path / "enwiki-pages-articles.xml.bz2"
        dump.write_bytes(package_file(*GENSIM_WIKI_DUMP).read_bytes()[:100_000])  # a real dump, cut short
        args, culprit = ["--wiki-dump", dump], f"{dump}: wikiextractor failed"
    else:
        out = Path(shutil.copytree(prepared, out))
        dupe = SLICE.index("--dupe-factor") + 1
        args, culprit = [*SLICE[:dupe], "3", *SLICE[dupe + 1 :]], f"{out / 'params.json'}: {out} was prepared"
    result = _run("prepare.py", *args, "--out", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert culprit in result.stderr
    if case != "other_params":
        assert not (out / "manifest.json").exists() and not list(out.rglob("*.hdf5"))


@pytest.fixture(scope="module")
def other_vocab_data(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """Data prepared with a vocab of the right format that is not the MLPerf one (one token appended)."""
    tmp = tmp_path_factory.mktemp("other_vocab")
    vocab = tmp / "vocab.txt"
    vocab.write_text(default_vocab_path().read_text().rstrip("\n") + "\nzzzextratoken\n")
    args = ["--text-dir", _text_dir(tmp, ENGLISH), "--vocab", vocab, "--max-seq-length", "32", "--dupe-factor", "1",
            "--eval-samples", "8", "--num-shards", "1", "--workers", "1"]
    return tmp / "out", vocab, _run("prepare.py", *args, "--out", tmp / "out")


def test_a_vocab_other_than_mlperfs_is_accepted_loudly_and_recorded(other_vocab_data, prepared):
    out, vocab, result = other_vocab_data
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1 and f"{vocab}: md5 {_md5(vocab)} is not the MLPerf vocab" in warning[0]
    assert "open division only" in warning[0]
    assert json.loads((out / "manifest.json").read_text())["vocab"]["mlperf"] is False
    assert json.loads((prepared / "manifest.json").read_text())["vocab"]["mlperf"] is True


def _driver(data: Path, tmp_path: Path, division: str) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / f"{division}.txt"
    evals = json.loads((data / "manifest.json").read_text())["eval_samples"]
    args = dict(input_dir=data / "train_varlength", eval_dir=data / "eval_varlength", bert_config_path="tiny",
                train_batch_size=2, learning_rate=1e-3, max_steps=1, num_eval_examples=evals, eval_batch_size=8,
                output_dir=tmp_path / division, mlperf_log=log, attention="padded", skip_checkpoint=1)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MLPERF_DIVISION": division}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        env.pop(name, None)  # a single process
    cmd = [sys.executable, str(ROOT / "run_pretraining.py"), *[x for k, v in args.items() for x in (f"--{k}", str(v))]]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    return run, log.read_text() if log.exists() else ""


def test_a_closed_run_refuses_data_of_another_vocab(other_vocab_data, tmp_path):
    out, _, _ = other_vocab_data
    closed, log = _driver(out, tmp_path, "closed")
    assert closed.returncode == 2, closed.stderr[-2000:]
    assert closed.stderr.strip().splitlines() == [
        f"error: rank 0: {out / 'train_varlength' / 'manifest.json'}: the data set was prepared with a vocab that is "
        "not the MLPerf vocab "
        "(md5 " + json.loads((out / "manifest.json").read_text())["vocab"]["md5"] + "); a closed-division run "
        "needs the MLPerf vocab (MLPERF_DIVISION=open to use this data)"]
    assert "run_start" not in log
    opened, log = _driver(out, tmp_path, "open")  # the open division may use any vocab
    assert opened.returncode in (0, 1) and '"key": "run_start"' in log, opened.stderr[-2000:]


def test_damaged_fixed_part_is_reported_on_resume(copy):
    part = copy / "fixed" / "part-00002.hdf5"
    part.write_bytes(part.read_bytes()[:5000])
    result = _run("prepare.py", *SLICE, "--out", copy)
    assert result.returncode == 2 and f"{part}: not a readable hdf5 file" in result.stderr


def test_fixed_to_varlength_cli_against_raw_hdf5(prepared, tmp_path):
    src = tmp_path / "fixed"
    shutil.copytree(prepared / "fixed", src)
    result = _run("convert_fixed2varlength.py", src, tmp_path / "varlength", "--workers", "1")
    assert result.returncode == 0, result.stderr
    for part in sorted(src.glob("*.hdf5")):
        with h5py.File(part, "r") as f, VarlenShard(tmp_path / "varlength" / part.name) as converted:
            raw = {key: f[key][()] for key in f}
            assert len(converted) == len(raw["input_ids"])
            for i, s in enumerate(converted):  # the reference: padding stripped by hand from the raw arrays
                n, m = raw["input_mask"][i].sum(), np.count_nonzero(raw["masked_lm_positions"][i])
                assert np.array_equal(s.input_ids, raw["input_ids"][i, :n])
                assert np.array_equal(s.segment_ids, raw["segment_ids"][i, :n])
                assert np.array_equal(s.masked_labels, raw["masked_lm_ids"][i, :m])
                assert s.nsp_label == raw["next_sentence_labels"][i]
    bad = src / "part-00000.hdf5"
    with h5py.File(bad, "a") as f:
        del f["input_mask"]
    (tmp_path / "varlength" / bad.name).unlink()
    result = _run("convert_fixed2varlength.py", src, tmp_path / "varlength")
    assert result.returncode == 2 and f"{bad}: missing key 'input_mask'" in result.stderr
