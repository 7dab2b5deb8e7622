"""Check a prepared dataset: every file against checksums.md5, then every shard's contents.

    python data/verify.py OUT [--vocab vocab.txt]

Exits non-zero, naming each culprit, if a file is missing, corrupt or truncated (md5 or hdf5
errors), has missing keys or wrong dtypes, or holds data that does not fit the vocab (token ids
beyond it, sequences not framed by its [CLS] ... [SEP]).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from md5_list import check_md5_list
from parallel_map import parallel_imap
from wordpiece import Vocab, VocabError, default_vocab_path, load_vocab

from bert.data.format import ShardError, VarlenShard

MAX_PROBLEMS_PER_FILE = 3


def check_shard(item: tuple[Path, Vocab]) -> list[str]:
    path, vocab = item
    try:
        with VarlenShard(path) as shard:
            lengths = shard.lengths()
            samples = list(shard)
    except ShardError as e:
        return [str(e)]
    problems = []
    for i, (s, length) in enumerate(zip(samples, lengths)):
        ids, pos = s.input_ids, s.masked_positions
        if len(ids) != length:
            problems.append(f"{path}: sample {i} has {len(ids)} tokens, its length index says {length}")
        elif ids.min() < 0 or max(ids.max(), s.masked_labels.max(initial=0)) >= vocab.size:
            problems.append(f"{path}: sample {i} has token ids outside {vocab.path} ({vocab.size} entries)")
        elif ids[0] != vocab.cls_id or ids[-1] != vocab.sep_id:
            problems.append(f"{path}: sample {i} is not [CLS] ... [SEP] in {vocab.path}; built with another vocab?")
        elif len(pos) and (pos.min() < 1 or pos.max() >= len(ids) - 1 or np.any(np.diff(pos) <= 0)):
            problems.append(f"{path}: sample {i} has masked positions that are unsorted or on [CLS]/[SEP]")
        if len(problems) >= MAX_PROBLEMS_PER_FILE:
            break
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory written by data/prepare.py")
    p.add_argument("--vocab", type=Path, help="default: the vocab named in manifest.json, else the MLPerf vocab")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    try:
        manifest = args.out / "manifest.json"
        vocab_path = args.vocab
        if vocab_path is None and manifest.is_file():
            vocab_path = Path(json.loads(manifest.read_text())["vocab"]["path"])
        vocab = load_vocab(vocab_path or default_vocab_path())
    except VocabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files, problems = check_md5_list(args.out / "checksums.md5")
    items = [(f, vocab) for f in files if f.is_file()]
    for found in parallel_imap(check_shard, items, args.workers, "verify shards"):
        problems.extend(found)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if problems or not files:
        print(f"{args.out}: {len(problems)} problem(s) in {len(files)} listed files", file=sys.stderr)
        return 1
    print(f"{args.out}: OK, {len(files)} files match checksums.md5 and fit {vocab.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
