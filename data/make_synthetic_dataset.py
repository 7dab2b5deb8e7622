"""A small, quickly learnable pre-training dataset in the varlength shard format.

Every sequence repeats one word drawn from a handful ([CLS] w w ... [SEP] w w ... [SEP]) and 15 %
of its words are masked, so a masked token is always recoverable from any unmasked neighbour: a
tiny BERT learns to copy it within a few hundred steps and passes the 0.720 MLM target. A share
(--label-noise, 10 %) of the masked labels is another word of the set, so the best MLM accuracy is
about 0.9: a fast learning rate cannot reach 1.0, which the official compliance checker rejects.
Used by the closed-division training test and the harness's package test; not a benchmark.

    python data/make_synthetic_dataset.py --out DIR   # DIR/train_varlength/*.hdf5, DIR/eval_varlength/*.hdf5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bert.data.format import write_varlength_shard
from bert.sample import Sample
from bert.synthetic import CLS, FIRST_WORD_ID, MASK, SEP


def repeated_word_sample(length: int, word: int, rng: np.random.Generator, mask_prob: float = 0.15) -> Sample:
    if length < 5:
        raise ValueError(f"a sample needs at least 5 tokens, got {length}")
    split = int(rng.integers(2, length - 2))  # position of the first [SEP]
    ids = np.full(length, word, dtype=np.int64)
    ids[[0, split, length - 1]] = CLS, SEP, SEP
    segments = (np.arange(length) > split).astype(np.int64)
    words = np.flatnonzero(ids == word)
    n_mask = max(1, round(len(words) * mask_prob))
    positions = np.sort(rng.choice(words, size=n_mask, replace=False))
    ids[positions] = MASK
    return Sample(ids, segments, positions, np.full(n_mask, word, dtype=np.int64), int(rng.integers(0, 2)))


def add_label_noise(sample: Sample, words: np.ndarray, share: float, rng: np.random.Generator) -> Sample:
    """Each masked label is, with probability `share`, replaced by a different word of `words`."""
    labels = sample.masked_labels.copy()
    for i in np.flatnonzero(rng.random(len(labels)) < share):
        labels[i] = rng.choice(words[words != labels[i]])
    return sample._replace(masked_labels=labels)


def make_samples(n: int, rng: np.random.Generator, num_words: int, min_len: int, max_len: int,
                 label_noise: float = 0.0) -> list[Sample]:
    words = FIRST_WORD_ID + rng.choice(1000, size=num_words, replace=False)
    return [add_label_noise(repeated_word_sample(int(rng.integers(min_len, max_len + 1)), int(rng.choice(words)), rng),
                            words, label_noise, rng)
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--train-samples", type=int, default=4096)
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--words", type=int, default=4, help="distinct words (chance accuracy = 1/words)")
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--label-noise", type=float, default=0.1,
                   help="share of masked labels replaced by another word (accuracy ceiling ~ 1 - share)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 5 <= args.min_len <= args.max_len <= 512:
        p.error(f"need 5 <= --min-len ({args.min_len}) <= --max-len ({args.max_len}) <= 512")
    if args.shards < 1 or args.train_samples < args.shards or args.eval_samples < 1:
        p.error("need --shards >= 1, --train-samples >= --shards and --eval-samples >= 1")
    if not 0.0 <= args.label_noise < 1.0 or (args.label_noise > 0 and args.words < 2):
        p.error(f"need 0 <= --label-noise ({args.label_noise}) < 1, and --words >= 2 for noise")
    rng = np.random.default_rng(args.seed)
    # One word set for train and eval: the eval measures copying, not memorising words.
    samples = make_samples(args.train_samples + args.eval_samples, rng, args.words, args.min_len, args.max_len,
                           args.label_noise)
    train, evals = samples[: args.train_samples], samples[args.train_samples :]
    (args.out / "train_varlength").mkdir(parents=True, exist_ok=True)
    (args.out / "eval_varlength").mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(np.array_split(np.arange(len(train)), args.shards)):
        name = f"part_{k:05d}_of_{args.shards:05d}.hdf5"
        write_varlength_shard(args.out / "train_varlength" / name, [train[i] for i in part])
    write_varlength_shard(args.out / "eval_varlength" / f"part_eval_{len(evals)}.hdf5", evals)
    print(f"{len(train)} training samples in {args.shards} shards, {len(evals)} eval samples under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
