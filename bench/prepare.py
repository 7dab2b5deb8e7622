"""Throughput of each offline preparation stage, one process, on the embedded corpus.

Stages run round-robin for --repeats rounds (interleaved, so load from other processes on the
machine hits every stage alike) and the median of each is reported. Prints a table and writes
results/bench/prepare.json. --end-to-end also times `data/prepare.py --embedded` once, cold.

    .venv/bin/python bench/prepare.py [--repeats 3] [--documents 2000] [--end-to-end]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per stage, as in a worker process

from corpus_sources import OVOS_SUMMARIES, package_file, summaries_documents  # noqa: E402
from pretraining_instances import PretrainingConfig, SpecialIds, create_instances  # noqa: E402
from sentence_split import document_sentences  # noqa: E402
from wordpiece import default_vocab_path, encode_sentences, load_vocab, make_tokenizer  # noqa: E402

from bert.data.format import FixedShard, VarlenShard, write_fixed_shard, write_varlength_shard  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--documents", type=int, default=2000, help="ovos summaries to use")
    p.add_argument("--end-to-end", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "results/bench/prepare.json")
    return p.parse_args()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    load = round(os.getloadavg()[0], 2)  # the machine is shared: record how busy it was
    texts = list(summaries_documents(package_file(*OVOS_SUMMARIES)))[: args.documents]
    vocab = load_vocab(default_vocab_path())
    tokenizer = make_tokenizer(vocab)
    ids = SpecialIds(vocab.cls_id, vocab.sep_id, vocab.mask_id, vocab.size)
    cfg = PretrainingConfig()  # MLPerf defaults, dupe_factor 10
    docs = [document_sentences(t) for t in texts]
    flat = [s for d in docs for s in d]
    encoded = iter(encode_sentences(tokenizer, flat))
    tokenized = [[next(encoded) for _ in d] for d in docs]
    samples = create_instances(tokenized, cfg, ids, random.Random(cfg.seed))
    words = sum(len(s.split()) for s in flat)
    tokens = sum(len(s) for d in tokenized for s in d)
    tmp = Path(tempfile.mkdtemp())
    fixed, varlen = tmp / "fixed.hdf5", tmp / "varlen.hdf5"
    write_fixed_shard(fixed, samples)
    write_varlength_shard(varlen, samples)
    batch = np.random.default_rng(0).choice(len(samples), size=256, replace=False)

    def convert():
        with FixedShard(fixed) as shard:
            write_varlength_shard(tmp / "converted.hdf5", shard.read(0, len(shard)))

    def read_batch():
        with VarlenShard(varlen) as shard:
            shard.read(batch)

    stages = {  # name: (work, amount, unit)
        "clean + sentence split": (lambda: [document_sentences(t) for t in texts], words, "words/s"),
        "WordPiece (tokenizers)": (lambda: encode_sentences(tokenizer, flat), tokens, "tokens/s"),
        "create_pretraining_data (dupe 10)": (
            lambda: create_instances(tokenized, cfg, ids, random.Random(cfg.seed)),
            tokens,
            "input tokens/s",
        ),
        "write fixed-length hdf5": (lambda: write_fixed_shard(tmp / "f2.hdf5", samples), len(samples), "samples/s"),
        "fixed -> varlength": (convert, len(samples), "samples/s"),
        "VarlenShard.read (256 random)": (read_batch, 256, "samples/s"),
    }
    seconds = {name: [] for name in stages}
    for _ in range(args.repeats):
        for name, (work, _, _) in stages.items():
            seconds[name].append(_timed(work))
    rows = []
    for name, (_, amount, unit) in stages.items():
        median = float(np.median(seconds[name]))
        rows.append({"stage": name, "amount": amount, "seconds": median, "rate": amount / median, "unit": unit})
    result = {
        "machine": f"{os.cpu_count()}-core CPU, 1 process",
        "load_average_1min_at_start": load,
        "documents": len(texts),
        "samples": len(samples),
        "repeats": args.repeats,
        "stages": rows,
    }
    if args.end_to_end:
        out = tmp / "e2e"
        cmd = [sys.executable, str(ROOT / "data/prepare.py"), "--embedded", "--out", str(out)]
        wall = _timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
        manifest = json.loads((out / "manifest.json").read_text())
        result["end_to_end"] = {
            "command": "data/prepare.py --embedded (MLPerf defaults, dupe_factor 10)",
            "workers": os.cpu_count(),
            "seconds": round(wall, 1),
            "train_samples": manifest["train_samples"],
            "eval_samples": manifest["eval_samples"],
        }
    print(f"{'stage':36s} {'rate':>14s}  unit            (median of {args.repeats}, {len(samples):,} samples)")
    for row in rows:
        print(f"{row['stage']:36s} {row['rate']:>14,.0f}  {row['unit']}")
    if "end_to_end" in result:
        e = result["end_to_end"]
        print(f"end to end, {e['workers']} workers: {e['seconds']} s for {e['train_samples']:,} train samples")
    shutil.rmtree(tmp)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
