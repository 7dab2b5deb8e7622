"""torchrun, 2 "nodes" x 2 ranks over gloo on localhost: every rank's batches equal a single-process plan."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from multiproc.id_shards import batch_ids, write_id_shards
from ports import free_port

from bert.data.pipeline import TrainLoader
from bert.lengths import WIKI_PHASE2

SCRIPT = Path(__file__).parent / "multiproc" / "loader_ranks.py"
STEPS, LOCAL_BATCH, STRATEGY = 6, 4, "samsung"


def test_torchrun_ranks_match_single_process(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "shards"
    write_id_shards(data, [np.maximum(WIKI_PHASE2.sample(n, rng), 3) for n in (23, 19, 31, 17, 26)])
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(SCRIPT), str(data), str(out), str(STEPS), STRATEGY, str(LOCAL_BATCH)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in launchers]
    finally:  # a launcher left waiting for its peer must not outlive the test, nor its workers
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(logs)

    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}
    assert sorted(records) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["per_node"] == 2 for r in records.values())
    assert sorted(records[0]["group"]) == [[0, 0], [1, 1], [2, 0], [3, 1]]  # node 1 = ranks 2, 3
    for rank, record in records.items():
        single = TrainLoader(data, LOCAL_BATCH, 4, rank, 2, strategy=STRATEGY, seed=7, shuffle_buffer=64)
        expected = [batch_ids(next(iter(single))) for _ in range(STEPS)]
        single.close()
        assert record["ids"] == expected, f"rank {rank}"
    # Node-local balancing only reshuffles what the node drew: the same draw without reassignment
    # ("stratified") gives each node the same set of samples.
    drawn = {}
    for rank in range(4):
        plain = TrainLoader(data, LOCAL_BATCH, 4, rank, 2, strategy="stratified", seed=7, shuffle_buffer=64)
        drawn[rank] = [batch_ids(next(iter(plain))) for _ in range(STEPS)]
        plain.close()
    for step in range(STEPS):
        for node in ((0, 1), (2, 3)):
            trained = sorted(g for r in node for g in records[r]["ids"][step])
            assert trained == sorted(g for r in node for g in drawn[r][step]), (step, node)
