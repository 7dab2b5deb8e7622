"""The data set's manifest.json (written by data/prepare.py) and what a closed-division run requires of it.

prepare.py writes OUT/manifest.json beside OUT/train_varlength and OUT/eval_varlength, and a copy inside each of
them (run.sub's containers mount the shard directories alone), so the manifest of a shard directory is looked for in
that directory, then in its parent (data prepared before the copies: rerun prepare.py, which only adds them). The
closed division must train on MLPerf's reference data: a manifest that records another vocab, or data not made by
the reference pipeline (`prepare.py --mlperf-text`, recorded as "pipeline": "reference"), refuses the run before
`run_start`.
Without a manifest nothing is checked: the official MLPerf shards and data/make_synthetic_dataset.py's set
come without one.
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "manifest.json"
MLPERF_VOCAB_MD5 = "64800d5d8528ce344256daf115d4965e"  # the md5 the MLPerf reference README lists
REFERENCE_PIPELINE = "reference"


class ManifestError(ValueError):
    """The data's manifest is unreadable or rules the data out for this run; the message names the manifest."""


def find_manifest(shard_dir: str | Path) -> Path | None:
    """The manifest.json that describes `shard_dir` (in it or in its parent), or None."""
    shard_dir = Path(shard_dir)
    for candidate in (shard_dir / MANIFEST, shard_dir.parent / MANIFEST):
        if candidate.is_file():
            return candidate
    return None


def _load(manifest: Path) -> dict:
    try:
        content = json.loads(manifest.read_text())
        md5 = content["vocab"]["md5"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{manifest}: unreadable manifest, no vocab md5 in it ({type(e).__name__}: {e})") from e
    if not isinstance(md5, str):
        raise ManifestError(f"{manifest}: vocab md5 {md5!r} is not a string")
    return content


def vocab_md5(manifest: Path) -> str:
    return _load(manifest)["vocab"]["md5"]


def check_data_for_division(division: str, *shard_dirs: str | Path) -> None:
    """Raise ManifestError if a closed-division run would train or evaluate on data of a non-MLPerf vocab, or on
    data the reference pipeline did not make (a manifest without "pipeline" predates it: not reference)."""
    if division != "closed":
        return  # the open division may use any data
    for manifest in dict.fromkeys(m for d in shard_dirs if (m := find_manifest(d)) is not None):
        content = _load(manifest)
        md5 = content["vocab"]["md5"]
        if md5 != MLPERF_VOCAB_MD5:
            raise ManifestError(
                f"{manifest}: the data set was prepared with a vocab that is not the MLPerf vocab (md5 {md5}); "
                "a closed-division run needs the MLPerf vocab (MLPERF_DIVISION=open to use this data)")
        pipeline = content.get("pipeline")
        if pipeline != REFERENCE_PIPELINE:
            raise ManifestError(
                f"{manifest}: the data set was not made by the reference pipeline (pipeline {pipeline!r}); a "
                "closed-division run needs MLPerf's data: data/prepare.py --mlperf-text results4/, or NVIDIA's "
                "prepared shards (they come without a manifest), or MLPERF_DIVISION=open to use this data")
