"""Random-token shards whose sequence lengths follow the Wikipedia phase-2 mix, for throughput benchmarks.

The model's cost depends on the lengths, not on the words, so a benchmark needs the real length mix and not
the real text: lengths are drawn from `bert.lengths.WIKI_PHASE2` (strata shares of [000] appendix C, 23 % at
512), tokens uniformly from the MLPerf vocab's words, framed [CLS] A [SEP] B [SEP] with a random split, and
masked as create_pretraining_data does ([Google-BERT]): min(76, max(1, round(0.15 x length))) positions
among the words, 80 % of them [MASK], 10 % a random word, 10 % unchanged. The shortest sequence is
--min-length (default 5, the shortest [CLS] A [SEP] B [SEP]); the first stratum keeps its share, spread over
min-length..128. Nothing here is learnable: use it for speed, never for accuracy.

    python data/make_random_shards.py --out DIR --samples 100000 --shards 8 [--eval-samples 10000]
    # DIR/train_varlength/part_KKKKK_of_NNNNN.hdf5, DIR/eval_varlength/part_eval_M.hdf5, DIR/checksums.md5
    python data/verify.py DIR

Every step is vectorised over all tokens of a shard (no per-token Python): 0.8 s of CPU per 10,000 samples
(about 2.5M tokens) on this 2-core VM, a fifth of it the hdf5 write.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
from md5_list import write_md5_list

from bert.data.format import MAX_PREDICTIONS, predictions_per_sequence, write_varlength_shard
from bert.lengths import WIKI_PHASE2, LengthMix
from bert.sample import Sample
from bert.synthetic import CLS, FIRST_WORD_ID, MASK, SEP

VOCAB_SIZE = 30522  # the MLPerf (bert-base-uncased) vocab


def length_mix(min_length: int) -> LengthMix:
    """WIKI_PHASE2 with its shortest sequence at `min_length` (strata shares unchanged)."""
    return replace(WIKI_PHASE2, min_length=min_length)


def random_samples(lengths: np.ndarray, rng: np.random.Generator, max_predictions: int = MAX_PREDICTIONS
                   ) -> list[Sample]:
    """One sample per entry of `lengths` (each >= 5), built on the concatenated token axis."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 5:
        raise ValueError(f"a [CLS] A [SEP] B [SEP] sample needs at least 5 tokens, got {lengths.min()}")
    n, total = len(lengths), int(lengths.sum())
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    seq = np.repeat(np.arange(n), lengths)  # the sequence of every token
    pos = np.arange(total) - starts[seq]  # position inside its sequence

    ids = rng.integers(FIRST_WORD_ID, VOCAB_SIZE, size=total)
    # The first [SEP] at 2 .. length-3: A and B have at least one word each.
    split = 2 + (rng.random(n) * (lengths - 4)).astype(np.int64)
    ids[starts[:-1]] = CLS
    ids[starts[:-1] + split] = SEP
    ids[starts[1:] - 1] = SEP
    segments = (pos > split[seq]).astype(np.int64)

    # Masked positions: every word gets a random key in [0, 0.5), framing tokens 0.75 (last); the n_pred smallest
    # keys of each sequence are its masked positions (a uniform draw without replacement, as rng.choice per
    # sequence). One argsort of sequence + key orders by sequence, then key (7x faster than lexsort).
    framing = (ids == CLS) | (ids == SEP)
    order = np.argsort(seq + np.where(framing, 0.75, 0.5 * rng.random(total)))
    n_pred = predictions_per_sequence(lengths, max_predictions)
    chosen = np.sort(order[(np.arange(total) - starts[seq[order]]) < n_pred[seq[order]]])
    labels = ids[chosen].copy()
    # 80 % [MASK], 10 % a random word, 10 % the word itself.
    u = rng.random(len(chosen))
    ids[chosen] = np.where(u < 0.8, MASK, np.where(u < 0.9, rng.integers(FIRST_WORD_ID, VOCAB_SIZE, len(chosen)),
                                                   labels))

    pred_starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_pred, out=pred_starts[1:])
    positions = chosen - starts[seq[chosen]]
    nsp = rng.integers(0, 2, size=n)
    cut, pred_cut = starts[1:-1], pred_starts[1:-1]
    return [Sample(i, s, p, lab, int(b)) for i, s, p, lab, b in
            zip(np.split(ids, cut), np.split(segments, cut), np.split(positions, pred_cut),
                np.split(labels, pred_cut), nsp)]


def write_shards(out: Path, samples: int, shards: int, eval_samples: int, mix: LengthMix, seed: int
                 ) -> tuple[list[Path], Path]:
    """Training shards of near-equal size and one eval shard; returns their paths."""
    rng = np.random.default_rng(seed)
    train_dir, eval_dir = out / "train_varlength", out / "eval_varlength"
    train_dir.mkdir(parents=True, exist_ok=True)
    eval_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, count in enumerate(np.diff(np.linspace(0, samples, shards + 1).astype(np.int64))):
        path = train_dir / f"part_{k:05d}_of_{shards:05d}.hdf5"
        write_varlength_shard(path, random_samples(mix.sample(int(count), rng), rng))
        paths.append(path)
    eval_path = eval_dir / f"part_eval_{eval_samples}.hdf5"
    write_varlength_shard(eval_path, random_samples(mix.sample(eval_samples, rng), rng))
    return paths, eval_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--samples", type=int, default=100_000, help="training samples over all shards")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=10_000, help="the MLPerf eval set's size by default")
    p.add_argument("--min-length", type=int, default=5, help="shortest sequence (5..128)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.shards < 1 or args.samples < args.shards or args.eval_samples < 1:
        p.error("need --shards >= 1, --samples >= --shards and --eval-samples >= 1")
    if not 5 <= args.min_length <= WIKI_PHASE2.edges[0]:
        p.error(f"--min-length must be in 5..{WIKI_PHASE2.edges[0]}, got {args.min_length}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shards, eval_path = write_shards(args.out, args.samples, args.shards, args.eval_samples,
                                     length_mix(args.min_length), args.seed)
    write_md5_list(args.out / "checksums.md5", [*shards, eval_path])
    print(f"{args.samples} random samples (WIKI_PHASE2 lengths) in {args.shards} shards, {args.eval_samples} eval "
          f"samples under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
