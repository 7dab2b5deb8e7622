"""Offline data preparation: Wikipedia text -> MLPerf varlength training shards + eval set.

    python data/prepare.py --embedded --out work/data                  # the embedded corpus, no network
    python data/prepare.py --wiki-dump enwiki-...-pages-articles.xml.bz2 --out /data/bert
    python data/prepare.py --mlperf-text results4/ --out /data/bert    # MLPerf's text, the reference's steps
    python data/verify.py work/data                                     # checksums + shard contents

Stages, each resumable (outputs are written under a temporary name and renamed when complete,
so a rerun skips what exists and redoes what was cut short):

    extracted/<dump>/             wikiextractor --json output of each dump
    text/part-NNNNN.txt, eval.txt cleaned, one sentence per line, blank line between documents
    fixed/part-NNNNN.hdf5         WordPiece + create_pretraining_data, MLPerf fixed-length layout
    train_varlength/part_KKKKK_of_NNNNN.hdf5, eval_varlength/part_eval_M.hdf5
    checksums.md5, manifest.json  written last: manifest.json exists only for a complete dataset

--mlperf-text skips the first two: each of MLPerf's part-* files and its eval.txt goes through
create_pretraining_data as it is, seeded with --seed (the reference's --random_seed=12345 for every
part), and the eval set is pick_eval_samples.py's evenly strided pick. Only that data, made with the
reference's parameters, is recorded as "pipeline": "reference", which a closed-division run requires;
the other inputs make "custom" data, for the open division.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from corpus_sources import (
    GENSIM_WIKI_DUMP,
    OVOS_SUMMARIES,
    CorpusError,
    extracted_documents,
    mlperf_text_parts,
    package_file,
    source_bytes,
    summaries_documents,
    text_dir_documents,
)
from fixed_parts import PartJob, make_fixed_part
from md5_list import write_md5_list
from parallel_map import parallel_imap
from pretraining_instances import PretrainingConfig
from sentence_split import MIN_PARAGRAPH_WORDS
from shard_split import REFERENCE_EVAL_SAMPLES, default_num_shards, plan_shards, write_eval_set, write_shard
from text_parts import EVAL_TEXT, write_text_parts
from wiki_extract import extract_dump
from wordpiece import MLPERF_VOCAB_MD5, VocabError, default_vocab_path, load_vocab

from bert.data.format import ShardError, VarlenShard, atomic_output

MAX_EVAL_FRACTION = 0.05  # a small corpus keeps most of its text for training
BYTES_PER_WORD, TOKENS_PER_WORD = 6.0, 1.3  # English Wikipedia, for sizing the held-out text
# Text parts are the unit of parallel work; 8 MiB of text needs ~1 GB in create_pretraining_data at dupe 10.
TEXT_PART_BYTES, MIN_TEXT_PARTS = 8 << 20, 8
# Keys params.json gained later, with the value they mean for a file written before: such a directory still resumes.
LATER_PARAMS = {"mlperf_text": None, "pipeline": "custom"}


class ParamsMismatch(ValueError):
    """The output directory holds data prepared from other inputs, parameters or vocab."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input (any combination, or --mlperf-text alone)")
    src.add_argument("--embedded", action="store_true", help="gensim's shortened enwiki dump + ovos summaries")
    src.add_argument("--wiki-dump", type=Path, action="append", default=[], help="pages-articles XML (.bz2)")
    src.add_argument("--text-dir", type=Path, action="append", default=[], help="*.txt, blank line between docs")
    src.add_argument("--max-documents", type=int, help="use only the first N documents of each source")
    src.add_argument("--mlperf-text", type=Path, metavar="DIR",
                     help="MLPerf's results4/ (part-* files + eval.txt) through the reference's steps")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", type=Path,
                   help="vocab.txt (default: the MLPerf vocab, md5-checked; another is for the open division only)")
    d = PretrainingConfig()
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--max-predictions-per-seq", type=int, default=d.max_predictions_per_seq)
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob)
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor)
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-shards", type=int, help="default: 4320, fewer for a small corpus (>= 1024 samples each)")
    p.add_argument("--eval-samples", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.mlperf_text and (args.embedded or args.wiki_dump or args.text_dir or args.max_documents is not None):
        p.error("--mlperf-text reads MLPerf's parts as they are: give it without --embedded, --wiki-dump, --text-dir "
                "and --max-documents")
    if not (args.embedded or args.wiki_dump or args.text_dir or args.mlperf_text):
        p.error("give --embedded, --wiki-dump, --text-dir or --mlperf-text")
    if args.dupe_factor < 1 or not 5 <= args.max_seq_length <= 32767 or args.eval_samples < 1:
        p.error("need --dupe-factor >= 1, 5 <= --max-seq-length <= 32767 (int16 shards) and --eval-samples >= 1")
    return args


def _sources(args: argparse.Namespace, out: Path) -> list[tuple[Iterator[str], int, Path]]:
    """(documents, min words per paragraph, input path) of each source; dumps are extracted first."""
    dumps = ([package_file(*GENSIM_WIKI_DUMP)] if args.embedded else []) + args.wiki_dump
    sources = []
    for dump in dumps:
        extracted = out / "extracted" / dump.name.split(".")[0]
        print(extract_dump(dump, extracted, args.workers))
        sources.append((extracted_documents(extracted), MIN_PARAGRAPH_WORDS, extracted))
    if args.embedded:
        summaries = package_file(*OVOS_SUMMARIES)
        sources.append((summaries_documents(summaries), MIN_PARAGRAPH_WORDS, summaries))
    for directory in args.text_dir:
        if not directory.is_dir():
            raise CorpusError(f"{directory}: no such text directory")
        sources.append((text_dir_documents(directory), 1, directory))  # one sentence per line: keep short ones
    return sources


def _documents(sources: list[tuple[Iterator[str], int, Path]], limit: int | None) -> Iterator[tuple[str, int]]:
    for documents, min_paragraph_words, _ in sources:
        for document in itertools.islice(documents, limit):
            yield document, min_paragraph_words


def _check_params(out: Path, params: dict) -> None:
    """Refuse to resume into a directory prepared with other inputs, parameters or vocab."""
    path = out / "params.json"
    # before the text stage (the fixed one for --mlperf-text), nothing depends on them yet
    if path.exists() and ((out / "text").is_dir() or (out / "fixed").is_dir()):
        old = {**LATER_PARAMS, **json.loads(path.read_text())}
        if old != params:
            diff = {k: (old.get(k), v) for k, v in params.items() if old.get(k) != v}
            raise ParamsMismatch(f"{path}: {out} was prepared with other settings {diff}; use a new --out")
    out.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(params, indent=1))


def pipeline(args: argparse.Namespace, cfg: PretrainingConfig) -> str:
    """What manifest.json records: reference (MLPerf's text, the reference's steps and parameters) or custom."""
    same = cfg == PretrainingConfig() and args.eval_samples == REFERENCE_EVAL_SAMPLES
    return "reference" if args.mlperf_text and same else "custom"


def prepare(args: argparse.Namespace) -> dict:
    out = args.out
    vocab = load_vocab(args.vocab or default_vocab_path())
    if not vocab.mlperf:
        print(f"WARNING: {vocab.path}: md5 {vocab.md5} is not the MLPerf vocab ({MLPERF_VOCAB_MD5}): this data is for "
              "the open division only; manifest.json records it and a closed-division run on it refuses to start",
              file=sys.stderr, flush=True)
    cfg = PretrainingConfig(
        args.max_seq_length,
        args.max_predictions_per_seq,
        args.masked_lm_prob,
        args.dupe_factor,
        args.short_seq_prob,
        args.seed,
    )
    inputs = {
        "embedded": args.embedded,
        "wiki_dumps": [str(p.resolve()) for p in args.wiki_dump],
        "text_dirs": [str(p.resolve()) for p in args.text_dir],
        "max_documents": args.max_documents,
        "mlperf_text": str(args.mlperf_text.resolve()) if args.mlperf_text else None,
    }
    kind = pipeline(args, cfg)
    if args.mlperf_text and kind != "reference":
        print(f"WARNING: --mlperf-text with parameters other than the reference's {asdict(PretrainingConfig())} and "
              f"--eval-samples {REFERENCE_EVAL_SAMPLES}: recorded as custom data, for the open division only",
              file=sys.stderr, flush=True)
    outputs = {"vocab_md5": vocab.md5, "eval_samples": args.eval_samples, "num_shards": args.num_shards,
               "pipeline": kind}
    _check_params(out, {**inputs, **asdict(cfg), **outputs})
    started = time.perf_counter()
    *train_parts, (eval_part, _) = _fixed_stage(args, cfg, vocab.path, _input_texts(args, cfg, out), out)
    shards, train_samples = _shard_stage(args, train_parts, out)
    eval_dir = _output_dir(out / "eval_varlength")
    eval_file = write_eval_set(eval_part, eval_dir, args.eval_samples, cfg.seed, reference=bool(args.mlperf_text))
    with VarlenShard(eval_file) as eval_set:
        eval_samples = len(eval_set)

    write_md5_list(out / "checksums.md5", [*shards, eval_file])
    manifest = {
        "train_dir": "train_varlength",
        "train_files": [p.name for p in shards],
        "train_samples": train_samples,
        "eval_file": str(eval_file.relative_to(out)),
        "eval_samples": eval_samples,
        "eval_samples_requested": args.eval_samples,
        "vocab": {"path": str(vocab.path), "md5": vocab.md5, "size": vocab.size, "mlperf": vocab.mlperf},
        "pretraining": asdict(cfg),
        "pipeline": kind,
        "seconds": round(time.perf_counter() - started, 1),
    }
    # A copy in each shard directory too: run.sub's containers mount those directories alone, and a closed run
    # checks the manifest it finds there (bert.data.manifest). The one in OUT is written last (dataset complete).
    for where in (out / "train_varlength", eval_dir, out):
        with atomic_output(where / "manifest.json") as tmp:
            tmp.write_text(json.dumps(manifest, indent=1))
    return manifest


def _text_stage(args: argparse.Namespace, cfg: PretrainingConfig, out: Path) -> Path:
    text = out / "text"
    if text.is_dir():
        return text
    sources = _sources(args, out)
    size = source_bytes([path for _, _, path in sources])
    # Enough held-out text for eval_samples full-length sequences (with 50 % to spare), capped.
    eval_words = 1.5 * args.eval_samples * cfg.max_seq_length / (cfg.dupe_factor * TOKENS_PER_WORD)
    fraction = min(MAX_EVAL_FRACTION, eval_words / max(1.0, size / BYTES_PER_WORD))
    num_parts = max(MIN_TEXT_PARTS, math.ceil(size / TEXT_PART_BYTES))
    counts = write_text_parts(_documents(sources, args.max_documents), text, num_parts, fraction, args.workers)
    print(f"text: {counts['documents']} documents ({counts['eval_documents']} held out for eval) under {text}")
    return text


def _input_texts(args: argparse.Namespace, cfg: PretrainingConfig, out: Path) -> list[Path]:
    """The text parts create_pretraining_data reads, the eval text last: MLPerf's as they are, or our text stage's."""
    if args.mlperf_text:
        parts, eval_text = mlperf_text_parts(args.mlperf_text)
        print(f"mlperf text: {len(parts)} parts and {eval_text.name} in {args.mlperf_text}")
        return [*parts, eval_text]
    text = _text_stage(args, cfg, out)
    return sorted(text.glob("part-*.txt")) + [text / EVAL_TEXT]


def _output_dir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    for stale in path.glob(".*.tmp-*"):  # left by an interrupted run; that output is redone
        stale.unlink()
    return path


def _fixed_stage(
    args: argparse.Namespace, cfg: PretrainingConfig, vocab: Path, texts: list[Path], out: Path
) -> list[tuple[Path, int]]:
    """Tokenize and create the samples of every text part: (fixed part, samples), the eval part last."""
    fixed = _output_dir(out / "fixed")
    jobs = [PartJob(t, fixed / (t.stem + ".hdf5"), vocab, cfg, reference=bool(args.mlperf_text)) for t in texts]
    start = time.perf_counter()
    stats = list(parallel_imap(make_fixed_part, jobs, args.workers, "tokenize+create_pretraining_data"))
    tokens = sum(s.tokens for s in stats)
    if tokens:
        rate = tokens / (time.perf_counter() - start)
        print(f"create_pretraining_data: {tokens:,} WordPiece tokens in, {rate:,.0f} tokens/s ({args.workers} workers)")
    skipped = sum(s.skipped for s in stats)
    if skipped:
        print(f"fixed: {skipped} of {len(stats)} parts were complete already and were skipped")
    return [(job.fixed, s.samples) for job, s in zip(jobs, stats)]


def _shard_stage(args: argparse.Namespace, parts: list[tuple[Path, int]], out: Path) -> tuple[list[Path], int]:
    """Chop the fixed parts into varlength shards: (shard paths, samples)."""
    counts = [n for _, n in parts]
    num_shards = args.num_shards or default_num_shards(sum(counts))
    jobs = plan_shards([p for p, _ in parts], counts, num_shards, _output_dir(out / "train_varlength"))
    sizes = list(parallel_imap(write_shard, jobs, args.workers, "chop+convert to varlength"))
    return [job.dst for job in jobs], sum(sizes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one tokenizer per worker process instead
    try:
        m = prepare(args)
    except (CorpusError, VocabError, ShardError, ParamsMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out
    print(f"train: {m['train_samples']:,} samples in {len(m['train_files'])} shards under {out / m['train_dir']}")
    small = "" if m["eval_samples"] == m["eval_samples_requested"] else " (small corpus: fewer than requested)"
    print(f"eval:  {m['eval_samples']:,} samples in {out / m['eval_file']}{small}")
    print(f"check: {out / 'checksums.md5'} (python data/verify.py {out}); manifest: {out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
