"""data/prepare.py --mlperf-text: MLPerf's results4/ text through the reference's steps, checked against the
reference's rules written out here (Google's reader loop, one random.Random(12345) per part, pick_eval_samples.py's
stride), on a small results4/-like directory; and the closed division's refusal of custom data."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import BertWordPieceTokenizer

from bert.data.format import FixedShard, VarlenShard, write_fixed_shard
from bert.data.manifest import ManifestError, check_data_for_division

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))

from corpus_sources import (  # noqa: E402
    OVOS_SUMMARIES,
    CorpusError,
    mlperf_text_parts,
    package_file,
    summaries_documents,
    text_dir_documents,
)
from pretraining_instances import PretrainingConfig, SpecialIds, create_instances  # noqa: E402
from sentence_split import document_sentences, parse_documents  # noqa: E402
from shard_split import write_eval_set  # noqa: E402
from wordpiece import default_vocab_path  # noqa: E402


def google_reader(text: str) -> list[list[str]]:
    """create_training_instances' loop over one input file: readline, strip, an empty line starts a document, empty
    documents are dropped (lines kept as text here; a line without tokens is dropped later, with the tokens)."""
    documents = [[]]
    reader = io.StringIO(text.replace("\r", ""), newline="\n")  # TF's GFile.readline drops every carriage return
    while True:
        line = reader.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            documents.append([])
        if line:
            documents[-1].append(line)
    return [d for d in documents if d]


@pytest.mark.parametrize("text", [
    "a b\nc\n\nd\n\n",  # our own format
    "a\n   \nb\n\t\n\nc",  # whitespace-only lines end documents; no newline at the end
    "a\r\nb\r\n\r\nc\r\n",  # CRLF
    "\n\n\na\n\n\n\nb\n",  # runs of blank lines, blank lines first
    "  a  \nb\u00a0\n\u2028\nc\x0cd\n",  # strip() takes Unicode spaces; only "\n" breaks a line
    "a\rb\nc",  # a lone carriage return: gone (TF), not a line break
])
def test_documents_are_read_as_googles_reader_reads_them(tmp_path, text):
    from fixed_parts import _read_text

    path = tmp_path / "part-00000-of-00001"
    path.write_bytes(text.encode("utf-8"))
    assert parse_documents(_read_text(path)) == google_reader(text)


def _results4(root: Path) -> Path:
    """A results4/-like directory: two extensionless parts and eval.txt, one sentence per line, with the quirks of
    real text (CRLF, whitespace-only and repeated blank lines between documents)."""
    root.mkdir()
    texts = [t for _, t in zip(range(90), summaries_documents(package_file(*OVOS_SUMMARIES)))]
    docs = ["\n".join(document_sentences(t)) for t in texts]
    docs = [d for d in docs if d]
    (root / "part-00000-of-00002").write_text("\n\n".join(docs[:30]) + "\n")
    (root / "part-00001-of-00002").write_bytes("\n \n".join(docs[30:60]).replace("\n", "\r\n").encode())
    (root / "eval.txt").write_text("\n\n\n".join(docs[60:]) + "\n\n")
    return root


def _prepare(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(ROOT / "data" / "prepare.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(results4, out, run): the reference pipeline with its own parameters."""
    tmp = tmp_path_factory.mktemp("reference")
    text = _results4(tmp / "results4")
    run = _prepare("--mlperf-text", text, "--workers", "2", "--out", tmp / "out")
    return text, tmp / "out", run


def _expected_samples(text_file: Path) -> list:
    """Google's create_pretraining_data on one file: its reader, WordPiece, then random.Random(12345)."""
    vocab = default_vocab_path()
    tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
    documents = [[tokenizer.encode(line, add_special_tokens=False).ids for line in doc]
                 for doc in google_reader(text_file.read_bytes().decode("utf-8"))]
    ids = SpecialIds(cls=101, sep=102, mask=103, vocab_size=30522)
    return create_instances(documents, PretrainingConfig(), ids, random.Random(12345))


def _same(got, want) -> bool:
    return len(got) == len(want) and all(
        all(np.array_equal(a[k], b[k]) for k in range(4)) and a.nsp_label == b.nsp_label for a, b in zip(got, want))


def test_each_part_is_create_pretraining_data_with_the_same_seed(reference):
    text, out, run = reference
    assert run.returncode == 0, run.stderr
    assert "WARNING" not in run.stderr and "mlperf text: 2 parts and eval.txt" in run.stdout
    assert not (out / "text").exists()  # no text stage: the parts are read as they are
    for name in ("part-00000-of-00002", "part-00001-of-00002", "eval"):
        source = text / (name if name != "eval" else "eval.txt")
        with FixedShard(out / "fixed" / f"{name}.hdf5") as fixed:
            assert _same(list(fixed), _expected_samples(source)), name


def test_reference_data_is_recorded_and_allowed_in_the_closed_division(reference):
    _, out, _ = reference
    manifest = json.loads((out / "manifest.json").read_text())
    params = json.loads((out / "params.json").read_text())
    assert manifest["pipeline"] == params["pipeline"] == "reference"
    with VarlenShard(out / manifest["eval_file"]) as picked, FixedShard(out / "fixed" / "eval.hdf5") as whole:
        assert manifest["eval_file"] == f"eval_varlength/part_eval_{len(whole)}.hdf5"  # fewer than 10,000: all
        assert _same(list(picked), list(whole))
    train = [s for name in manifest["train_files"] for s in VarlenShard(out / "train_varlength" / name)]
    parts = [s for p in sorted((out / "fixed").glob("part-*.hdf5")) for s in FixedShard(p)]
    assert _same(train, parts)
    check_data_for_division("closed", out / "train_varlength", out / "eval_varlength")


def test_other_parameters_make_custom_data_with_the_stride_pick(reference, tmp_path):
    text, _, _ = reference
    out = tmp_path / "out"
    run = _prepare("--mlperf-text", text, "--eval-samples", "7", "--dupe-factor", "2", "--workers", "1", "--out", out)
    assert run.returncode == 0, run.stderr
    assert "recorded as custom data, for the open division only" in run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["pipeline"] == "custom" and manifest["eval_file"] == "eval_varlength/part_eval_7.hdf5"
    with VarlenShard(out / manifest["eval_file"]) as picked, FixedShard(out / "fixed" / "eval.hdf5") as whole:
        num_examples = len(whole)
        pick_ratio = num_examples / 7
        rows = [int(i * pick_ratio) for i in range(7)]  # pick_eval_samples.py
        assert _same(list(picked), [whole.read(r, r + 1)[0] for r in rows])
    inner = out / "train_varlength" / "manifest.json"  # the copy a container mounting the shards alone sees
    with pytest.raises(ManifestError, match=f"^{inner}: the data set was not made by the reference "):
        check_data_for_division("closed", out / "train_varlength")
    rerun = _prepare("--mlperf-text", text, "--eval-samples", "7", "--dupe-factor", "3", "--out", out)
    assert rerun.returncode == 2 and f"{out / 'params.json'}: {out} was prepared with other settings" in rerun.stderr


def test_reference_eval_pick_and_its_file_name(tmp_path):
    write_fixed_shard(tmp_path / "eval.hdf5", [_tagged(g) for g in range(25_000)], 8, 2)
    dst = write_eval_set(tmp_path / "eval.hdf5", tmp_path, 10_000, seed=0, reference=True)
    assert dst.name == "part_eval_10k.hdf5"
    with VarlenShard(dst) as picked:
        got = [int(s.input_ids[1]) for s in picked]
    assert got == [int(i * 2.5) for i in range(10_000)]  # 0 2 5 7 10 ..


def _tagged(g: int):
    from bert.batch import Sample

    return Sample(np.array([101, g % 30000, 102]), np.array([0, 0, 0]), np.array([1]), np.array([g % 30000]), 0)


@pytest.mark.parametrize("args, message", [
    (["--embedded"], "--mlperf-text reads MLPerf's parts as they are"),
    (["--text-dir", "x"], "--mlperf-text reads MLPerf's parts as they are"),
    (["--max-documents", "3"], "--mlperf-text reads MLPerf's parts as they are"),
])
def test_mlperf_text_goes_alone(tmp_path, args, message):
    run = _prepare("--mlperf-text", tmp_path, *args, "--out", tmp_path / "out")
    assert run.returncode == 2 and message in run.stderr


def test_results4_needs_parts_and_eval_and_text_dir_refuses_it(tmp_path):
    results4 = tmp_path / "results4"
    results4.mkdir()
    (results4 / "eval.txt").write_text("An eval sentence.\n")
    with pytest.raises(CorpusError, match=f"^{results4}: not MLPerf's results4/ text: .*found 0 part-\\* files"):
        mlperf_text_parts(results4)
    (results4 / "part-00000-of-00500").write_text("A training sentence.\n")
    assert mlperf_text_parts(results4) == ([results4 / "part-00000-of-00500"], results4 / "eval.txt")
    with pytest.raises(CorpusError, match=f"^{results4}: this is MLPerf's results4/ text .* use --mlperf-text"):
        text_dir_documents(results4)  # it would have read eval.txt only, and trained on it
    run = _prepare("--text-dir", results4, "--out", tmp_path / "out")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(f"error: {results4}: this is MLPerf")
    (results4 / "eval.txt").unlink()
    with pytest.raises(CorpusError, match="eval.txt missing"):
        mlperf_text_parts(results4)
    # eval.txt beside parts that are .txt files: an ordinary text directory, read as before
    (results4 / "eval.txt").write_text("An eval sentence.\n")
    (results4 / "part-00000-of-00500").rename(results4 / "part-00000-of-00500.txt")
    assert sorted(text_dir_documents(results4)) == ["A training sentence.\n", "An eval sentence.\n"]


def test_an_empty_part_is_one_error_line_naming_it(tmp_path):
    """A blank part (a broken download) stops prepare.py in one line naming the file, not with h5py's traceback about a
    chunk larger than its data."""
    results4 = tmp_path / "results4"
    results4.mkdir()
    (results4 / "eval.txt").write_text("An eval sentence.\nAnd another one.\n")
    (results4 / "part-00000-of-00002").write_text("A training sentence.\nA second sentence.\n")
    (results4 / "part-00001-of-00002").write_text("\n  \n")
    run = _prepare("--mlperf-text", results4, "--out", tmp_path / "out", "--workers", "1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == \
        f"error: {results4 / 'part-00001-of-00002'}: no text to make samples of (empty or blank)"
