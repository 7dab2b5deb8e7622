"""Ranks whose copies of the data differ stop before training (bert.data.index_agreement)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from multiproc.id_shards import write_id_shards
from ranks import start_ranks

from bert.data.index import LengthIndex
from bert.data.index_agreement import check_index_agreement, disagreeing_ranks, index_digest

SHARDS = [[5, 9, 7], [12, 4], [8, 8, 30]]


def index(directory: Path, shards=SHARDS) -> LengthIndex:
    write_id_shards(directory, shards)
    return LengthIndex.scan(directory)


def test_the_digest_sees_a_missing_shard_a_changed_length_and_a_renamed_file(tmp_path):
    base = index_digest(index(tmp_path / "a"))
    assert base == index_digest(index(tmp_path / "b")) and 0 <= base < 2**63  # same data elsewhere: same digest
    assert base != index_digest(index(tmp_path / "c", SHARDS[:2] + [[8, 8]]))  # a partial copy
    assert base != index_digest(index(tmp_path / "d", [[5, 9, 7], [12, 5], [8, 8, 30]]))  # one length differs
    renamed = index(tmp_path / "e")
    (tmp_path / "e" / renamed.paths[1].name).rename(tmp_path / "e" / "part_00001_of_00003.h5")
    assert base != index_digest(LengthIndex.scan(tmp_path / "e"))
    train, evals = index(tmp_path / "f"), index(tmp_path / "g", [[6, 6]])
    assert index_digest(train, evals) != index_digest(train) != index_digest(evals)
    assert disagreeing_ranks([7, 7, 3, 7, 3]) == [2, 4] and disagreeing_ranks([7, 7]) == []


def _worker(rank: int, store: str, data: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    # rank 2's node lacks the last shard
    shards = SHARDS if rank < 2 else SHARDS[:2]
    try:
        check_index_agreement(torch.device("cpu"), index(Path(data) / f"rank{rank}", shards))
        result = "agreed"
    except ValueError as e:
        result = str(e)
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def test_a_rank_with_a_partial_copy_stops_every_rank_naming_it(tmp_path):
    start_ranks(_worker, args=(str(tmp_path / "store"), str(tmp_path), str(tmp_path / "out")), nprocs=3)
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    assert all("rank(s) 2 of 3 see other shards or sample lengths than rank 0" in r for r in results), results


def test_one_process_checks_nothing(tmp_path):
    check_index_agreement(torch.device("cpu"), index(tmp_path))  # no process group: nothing to compare, no error
