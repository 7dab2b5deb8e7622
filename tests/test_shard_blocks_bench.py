"""bench/shard_blocks.py on the CPU: each block of the sharded masters' gradient starts once, last block first, and
BERT `tiny` (whose word embeddings are most of it) starts every block with its last gradient."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_block_starts_once_and_the_first_last(tmp_path):
    out = tmp_path / "shard_blocks.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench/shard_blocks.py"), "--models", "tiny", "--blocks", "3",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert [b for b, _ in row["started"]] == [2, 1, 0]
    assert all(at == row["gradients"] == 38 for _, at in row["started"]) and row["before_the_end"] == 0
    assert "tiny" in run.stdout
