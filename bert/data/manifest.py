"""The data set's manifest.json (written by data/prepare.py) and what a closed-division run requires of it.

prepare.py writes OUT/manifest.json beside OUT/train_varlength and OUT/eval_varlength, so the manifest of a
shard directory is looked for in that directory, then in its parent. The closed division must train on data
tokenized with the MLPerf vocab: a manifest that records another vocab refuses the run before `run_start`.
Without a manifest nothing is checked: the official MLPerf shards and data/make_synthetic_dataset.py's set
come without one, and run.sub's containers mount only the shard directories (not their parent).
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "manifest.json"
MLPERF_VOCAB_MD5 = "64800d5d8528ce344256daf115d4965e"  # the md5 the MLPerf reference README lists


class ManifestError(ValueError):
    """The data's manifest is unreadable or rules the data out for this run; the message names the manifest."""


def find_manifest(shard_dir: str | Path) -> Path | None:
    """The manifest.json that describes `shard_dir` (in it or in its parent), or None."""
    shard_dir = Path(shard_dir)
    for candidate in (shard_dir / MANIFEST, shard_dir.parent / MANIFEST):
        if candidate.is_file():
            return candidate
    return None


def vocab_md5(manifest: Path) -> str:
    try:
        md5 = json.loads(manifest.read_text())["vocab"]["md5"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{manifest}: unreadable manifest, no vocab md5 in it ({type(e).__name__}: {e})") from e
    if not isinstance(md5, str):
        raise ManifestError(f"{manifest}: vocab md5 {md5!r} is not a string")
    return md5


def check_data_for_division(division: str, *shard_dirs: str | Path) -> None:
    """Raise ManifestError if a closed-division run would train or evaluate on data of a non-MLPerf vocab."""
    if division != "closed":
        return  # the open division may use any vocab
    for manifest in dict.fromkeys(m for d in shard_dirs if (m := find_manifest(d)) is not None):
        md5 = vocab_md5(manifest)
        if md5 != MLPERF_VOCAB_MD5:
            raise ManifestError(
                f"{manifest}: the data set was prepared with a vocab that is not the MLPerf vocab (md5 {md5}); "
                "a closed-division run needs the MLPerf vocab (MLPERF_DIVISION=open to use this data)")
