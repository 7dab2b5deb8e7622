"""Check a prepared dataset: every file against checksums.md5, then every shard's contents.

    python data/verify.py OUT [--vocab vocab.txt]
    python data/verify.py OUT --chk 4320_shards_varlength.chk --chk eval_varlength.chk   # NVIDIA's lists

Exits non-zero, naming each culprit, if a file is missing, corrupt or truncated (md5 or hdf5
errors), has missing keys or wrong dtypes, or holds data that does not fit the vocab (token ids
beyond it, sequences not framed by its [CLS] ... [SEP]). `--chk` (repeatable) checks a list in
NVIDIA's hdf5_md5.py format ("name<TAB>md5" of the input_ids, data/hdf5_content_md5.py), each file
found by name under OUT; with only --chk lists, OUT needs no checksums.md5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from hdf5_content_md5 import check_chk
from md5_list import check_md5_list
from parallel_map import parallel_imap
from wordpiece import Vocab, VocabError, default_vocab_path, load_vocab

from bert.data.format import ShardError, VarlenShard

MAX_PROBLEMS_PER_FILE = 3
MD5_LIST = "checksums.md5"


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


def _load_vocab(out: Path, given: Path | None) -> Vocab:
    manifest = out / "manifest.json"
    if given is None and manifest.is_file():
        given = Path(json.loads(manifest.read_text())["vocab"]["path"])
    return load_vocab(given or default_vocab_path())


def check_listed(out: Path, vocab: Vocab, workers: int) -> tuple[list[Path], list[str]]:
    """The files checksums.md5 lists, and the problems of the list's md5s and of every listed shard's contents."""
    files, problems = check_md5_list(out / MD5_LIST)
    items = [(f, vocab) for f in files if f.is_file()]
    for found in parallel_imap(check_shard, items, workers, "verify shards"):
        problems.extend(found)
    return files, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory written by data/prepare.py (or holding the files --chk lists)")
    p.add_argument("--vocab", type=Path, help="default: the vocab named in manifest.json, else the MLPerf vocab")
    p.add_argument("--chk", type=Path, action="append", default=[],
                   help="an NVIDIA content checksum list (name<TAB>md5); repeatable")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    checks = []  # (what was checked, files listed, problems)
    if not args.chk or (args.out / MD5_LIST).is_file():
        try:
            vocab = _load_vocab(args.out, args.vocab)
        except VocabError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        files, problems = check_listed(args.out, vocab, args.workers)
        checks.append((f"match {MD5_LIST} and fit {vocab.path}", len(files), problems))
    for chk in args.chk:
        listed, problems = check_chk(chk, args.out, args.workers)
        checks.append((f"match {chk}", listed, problems))
    failed = False
    for what, listed, problems in checks:
        for problem in problems:
            print(f"FAILED: {problem}", file=sys.stderr)
        if problems or not listed:
            failed = True
            print(f"{args.out}: {len(problems)} problem(s) in {listed} listed files", file=sys.stderr)
        else:
            print(f"{args.out}: OK, {listed} files {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
