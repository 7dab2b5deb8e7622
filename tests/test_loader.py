"""TrainLoader and eval_batches on real varlength shards written in tmp_path."""

import threading
import time

import numpy as np
import pytest
import torch
from multiproc.id_shards import batch_ids, id_sample, write_id_shards

from bert.batch import collate
from bert.data.format import ShardError
from bert.data.pipeline import TrainLoader, eval_batches
from bert.data.prefetch import Prefetcher
from bert.lengths import WIKI_PHASE2
from bert.static_shapes import MASKED_BUCKET

# Samsung [000] Figure 4: one node of 4 GPUs drawing 4 sequences each (lengths are ours, the
# figure's numbers are not in the text). All 16 are gathered, sorted descending into rows
#   [512 512 510 450] [400 350 300 256] [200 180 128 100] [80 60 40 20]
# and GPU i takes column i (raster) or column i of the rows with every second row reversed (snake).
FIG4 = [[512, 100, 300, 60], [128, 450, 40, 200], [512, 80, 256, 350], [20, 400, 180, 510]]
RASTER = [512 + 400 + 200 + 80, 512 + 350 + 180 + 60, 510 + 300 + 128 + 40, 450 + 256 + 100 + 20]
SNAKE = [512 + 256 + 200 + 20, 512 + 300 + 180 + 40, 510 + 350 + 128 + 60, 450 + 400 + 100 + 80]


def loaders(directory, world=4, local=4, per_node=4, **kw):
    return [TrainLoader(directory, local, world, r, per_node, **kw) for r in range(world)]


def take(loader, steps):
    return [next(loader) for _ in range(steps)]


@pytest.fixture
def wiki_dir(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [41, 37, 52, 45, 30]  # 205 samples: epochs do not end on a step boundary
    write_id_shards(tmp_path, [np.maximum(WIKI_PHASE2.sample(n, rng), 3) for n in sizes])
    return tmp_path


@pytest.mark.parametrize("strategy,expected", [("local", RASTER), ("snake", SNAKE)])
def test_figure4_through_the_pipeline(tmp_path, strategy, expected):
    write_id_shards(tmp_path, FIG4)  # one shard per GPU: each draws one row of the figure
    tokens = [iter(ld).__next__().num_tokens for ld in loaders(tmp_path, strategy=strategy)]
    assert tokens == expected
    assert max(SNAKE) - min(SNAKE) < max(RASTER) - min(RASTER)
    unbalanced = [iter(ld).__next__().num_tokens for ld in loaders(tmp_path, strategy="none")]
    assert sorted(unbalanced) == sorted(sum(row) for row in FIG4)


def test_batches_hold_the_planned_samples_and_their_data(wiki_dir):
    lds = loaders(wiki_dir, world=2, local=8, per_node=1, strategy="global", shuffle_buffer=16)
    lengths = lds[0].plan.index.lengths
    for step in range(30):  # crosses an epoch boundary (205 samples, 16 per step)
        for rank, ld in enumerate(lds):
            batch = next(iter(ld))
            ids = batch_ids(batch)
            assert ids == ld.plan.rank_ids(step, rank).tolist()
            expected = collate([id_sample(g, int(lengths[g])) for g in ids])
            for field in ("input_ids", "segment_ids", "position_ids", "masked_positions", "masked_labels",
                          "nsp_labels"):
                assert torch.equal(getattr(batch, field), getattr(expected, field)), field
            assert batch.seq.lengths == tuple(int(lengths[g]) for g in ids)
            assert torch.equal(batch.seq.cu_seqlens, expected.seq.cu_seqlens)
    assert lds[0].samples_seen == 30 * 16
    for ld in lds:
        ld.close()


def test_ranks_together_see_every_sample_once_per_epoch(wiki_dir):
    lds = loaders(wiki_dir, world=4, local=4, per_node=2, strategy="samsung", shuffle_buffer=8)
    seen = [[g for ld in lds for g in batch_ids(next(ld))] for _ in range(2 * 205 // 16 + 1)]
    drawn = [g for step in range(len(seen)) for g in lds[0].plan.draw(step).ravel()]
    assert all(sorted(s) == sorted(drawn[16 * t : 16 * t + 16]) for t, s in enumerate(seen))
    assert sorted(drawn[:205]) == list(range(205)) and sorted(drawn[205:410]) == list(range(205))


def test_empty_shards_are_skipped(tmp_path):
    write_id_shards(tmp_path, [[5, 6], [], [7, 8, 9], []])  # ids 0 1 | - | 2 3 4 | -
    ld = TrainLoader(tmp_path, 5, 1, 0, 1)
    assert sorted(batch_ids(next(ld))) == [0, 1, 2, 3, 4]
    assert sorted(ld.plan.index.lengths[[0, 1, 2, 3, 4]]) == [5, 6, 7, 8, 9]
    ld.close()


def test_seed_decides_the_order(wiki_dir):
    def first_ids(seed):
        ld = TrainLoader(wiki_dir, 8, 2, 0, 2, strategy="snake", seed=seed)
        return [batch_ids(b) for b in take(ld, 5)]

    assert first_ids(1) == first_ids(1)
    assert first_ids(1) != first_ids(2)


def test_resume_continues_with_the_identical_batches(wiki_dir):
    ld = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10, prefetch=3)
    take(ld, 11)
    state = ld.state_dict()
    after = [batch_ids(b) for b in take(ld, 6)]  # steps 11..16 cross the epoch boundary (205 / 16)
    fresh = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    fresh.load_state_dict(state)
    assert [batch_ids(b) for b in take(fresh, 6)] == after
    assert fresh.samples_seen == 17 * 16
    ld.load_state_dict(state)  # rewinding a running loader works too
    assert batch_ids(next(ld)) == after[0]
    other = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="snake", seed=3, shuffle_buffer=10)
    with pytest.raises(ValueError, match="strategy"):
        other.load_state_dict(state)
    reseeded = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=4, shuffle_buffer=10)
    with pytest.raises(ValueError, match=r"'seed': \(3, 4\)"):  # another order of the same samples: not a resume
        reseeded.load_state_dict(state)
    for x in (ld, fresh, other, reseeded):
        x.close()


def test_resume_refuses_another_data_set(wiki_dir, tmp_path):
    """A checkpoint continued on a data set of another size would count its epochs over other samples."""
    ld = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    take(ld, 2)
    state = ld.state_dict()
    ld.close()
    write_id_shards(tmp_path / "other", [[5, 6, 7] * 20])
    other = TrainLoader(tmp_path / "other", 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    with pytest.raises(ValueError, match=r"'num_samples': \(205, 60\)"):
        other.load_state_dict(state)
    other.close()


def test_resume_at_another_world_size_carries_the_sample_count(wiki_dir, capsys):
    ld = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    take(ld, 5)  # 5 steps x 16 = 80 samples
    state = ld.state_dict()
    for world, per_node, step in ((1, 1, 10), (4, 2, 3)):  # 80 / 8 = 10; ceil(80 / 32) = 3
        other = TrainLoader(wiki_dir, 8, world, 0, per_node, strategy="samsung", seed=3, shuffle_buffer=10)
        other.load_state_dict(state)
        assert other.step == step and other.samples_seen >= 80 > other.samples_seen - other.plan.global_batch_size
        assert f"plan made for 2 ranks on {world}" in capsys.readouterr().out
        assert batch_ids(next(other)) == batch_ids(other._batch(step))  # it trains on from there
        other.close()
    ld.close()


def test_plan_ahead_lays_out_the_epoch_before_the_first_batch_needs_it(wiki_dir, monkeypatch):
    """The whole epoch's order (40 s per rank for phase 2 at 1024 ranks) is made by `plan_ahead` in the
    initialisation, not by the first batch inside the timed run; after a resume, the epoch it continues in."""
    import bert.data.plan as plan_module

    laid_out = []
    real = plan_module.lay_out_epoch
    monkeypatch.setattr(plan_module, "lay_out_epoch", lambda *a, **k: laid_out.append(1) or real(*a, **k))
    ld = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    ld.plan_ahead()
    assert len(laid_out) == 1 and set(ld.plan._epochs) == {0}
    take(ld, 3)  # steps 0-2 (and the prefetched ones) of epoch 0: nothing more laid out
    assert len(laid_out) == 1
    state = {**ld.state_dict(), "step": 13}  # 13 x 16 = 208 samples: epoch 1 (205 samples an epoch)
    ld.close()
    resumed = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    resumed.load_state_dict(state)
    resumed.plan_ahead()
    assert set(resumed.plan._epochs) == {1} and len(laid_out) == 2
    resumed.close()


def test_static_tokens_pads_in_the_loader_before_the_batch_leaves_the_thread(wiki_dir):
    plain = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10)
    padded = TrainLoader(wiki_dir, 8, 2, 1, 2, strategy="samsung", seed=3, shuffle_buffer=10, static_tokens=128)
    for a, b in zip(take(plain, 3), take(padded, 3)):
        assert b.num_tokens % 128 == 0 and b.seq.lengths[:-1] == a.seq.lengths  # one padding sequence after the rest
        assert torch.equal(b.input_ids[: a.num_tokens], a.input_ids) and b.masked_labels.numel() % MASKED_BUCKET == 0
    plain.close()
    padded.close()


def test_eval_slices_partition_the_eval_set(wiki_dir):
    slices = [eval_batches(wiki_dir, 6, 3, rank, 100) for rank in range(3)]
    ids = [[g for b in batches for g in batch_ids(b)] for batches in slices]
    assert sorted(g for part in ids for g in part) == list(range(100))
    assert [len(part) for part in ids] == [34, 33, 33]
    assert all(b.num_sequences <= 6 for batches in slices for b in batches)
    whole = [eval_batches(wiki_dir, 64, 2, rank, 205) for rank in range(2)]  # every sample the set holds
    assert sorted(g for batches in whole for b in batches for g in batch_ids(b)) == list(range(205))
    with pytest.raises(ValueError, match=f"{wiki_dir}.*holds 205"):
        eval_batches(wiki_dir, 6, 3, 0, 206)


def test_eval_set_is_read_at_its_first_use_and_kept(wiki_dir, monkeypatch):
    """Nothing but the length index before the first iteration (the rules' clock starts before the dataset is
    touched: the driver builds it before run_start); then one read per batch, once."""
    from bert.data.pipeline import EvalSet
    from bert.data.reader import SampleReader

    reads: list[int] = []
    read = SampleReader.read
    monkeypatch.setattr(SampleReader, "read", lambda self, ids: reads.append(len(ids)) or read(self, ids))
    evals = EvalSet(wiki_dir, 6, 3, 1, 100)
    assert reads == [] and not evals.loaded and evals.batch_sizes == [6] * 5 + [3]
    first = list(evals)
    assert reads == evals.batch_sizes and [b.num_sequences for b in first] == evals.batch_sizes
    assert list(evals) == first and len(reads) == 6  # kept: the same batches, no second read
    monkeypatch.setattr(SampleReader, "read", read)
    assert [batch_ids(b) for b in first] == [batch_ids(b) for b in eval_batches(wiki_dir, 6, 3, 1, 100)]


def test_static_tokens_pads_the_eval_batches_to_the_shapes_the_index_names(wiki_dir):
    """STATIC_TOKENS pads the eval batches as the loader pads the training batches; `shapes`, from the length index
    alone, says what each batch will be (the compile warm-up records those shapes before run_start)."""
    from bert.data.pipeline import EvalSet

    plain, padded = EvalSet(wiki_dir, 6, 3, 1, 100), EvalSet(wiki_dir, 6, 3, 1, 100, static_tokens=128)
    assert padded.shapes and not padded.loaded
    assert plain.shapes == [(b.num_sequences, b.num_tokens) for b in plain]
    assert padded.shapes == [(b.num_sequences - 1, b.num_tokens) for b in padded]
    for a, b in zip(plain, padded):
        assert b.num_tokens % 128 == 0 and b.seq.lengths[:-1] == a.seq.lengths  # one padding sequence after the rest
        assert torch.equal(b.input_ids[: a.num_tokens], a.input_ids) and b.masked_labels.numel() % MASKED_BUCKET == 0
        real = a.masked_labels.numel()
        assert torch.equal(b.masked_labels[:real], a.masked_labels) and (b.masked_labels[real:] == -100).all()


def test_bad_inputs_name_the_culprit(tmp_path, wiki_dir):
    with pytest.raises(FileNotFoundError, match="missing"):
        TrainLoader(tmp_path / "missing", 4, 1, 0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no shards"):
        TrainLoader(tmp_path / "empty", 4, 1, 0, 1)
    write_id_shards(tmp_path / "hollow", [[]])
    with pytest.raises(ShardError, match="hollow: all 1 shards are empty"):
        TrainLoader(tmp_path / "hollow", 4, 1, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        TrainLoader(wiki_dir, 4, 2, 2, 1)
    shard = sorted(wiki_dir.glob("*.hdf5"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ShardError, match=shard.name):
        TrainLoader(wiki_dir, 4, 1, 0, 1)
    shard.write_bytes(b"not hdf5" * 100)
    with pytest.raises(ShardError, match=shard.name):
        eval_batches(wiki_dir, 4, 1, 0, 10)


def test_read_errors_in_the_background_reach_the_caller(wiki_dir):
    ld = TrainLoader(wiki_dir, 16, 1, 0, 1, shuffle_buffer=1)
    for shard in wiki_dir.glob("*.hdf5"):
        shard.write_bytes(b"gone")  # damaged after the index was built
    with pytest.raises(ShardError, match="part_"):
        next(iter(ld))
    ld.close()


def test_prefetcher_builds_ahead_in_its_own_thread():
    produced = []

    def produce(step):
        produced.append((step, threading.get_ident()))
        return collate([id_sample(step, 5)])

    worker = Prefetcher(produce, start=3, depth=2, pin=False)
    assert batch_ids(worker.next()) == [3]
    deadline = time.monotonic() + 5
    while len(produced) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    # Steps 4 and 5 wait in the queue, step 6 is built and waits for room; nothing further.
    assert [step for step, _ in produced] == [3, 4, 5, 6]
    assert {ident for _, ident in produced} == {produced[0][1]} != {threading.get_ident()}
    assert [batch_ids(worker.next()) for _ in range(3)] == [[4], [5], [6]]
    worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_arrive_on_the_device_with_host_lengths(wiki_dir):
    ld = TrainLoader(wiki_dir, 8, 1, 0, 1, device="cuda")
    batch = next(iter(ld))
    assert batch.input_ids.is_cuda and batch.seq.cu_seqlens.is_cuda
    assert isinstance(batch.seq.max_seqlen, int) and sum(batch.seq.lengths) == batch.input_ids.numel()
    ld.close()


def test_reader_keeps_as_many_shards_open_as_the_file_limit_allows(tmp_path):
    from bert.data.index import LengthIndex
    from bert.data.reader import SampleReader, open_file_budget

    # A quarter of the soft limit, never more than the shards there are, never zero.
    assert open_file_budget(4320, 1024) == 256
    assert open_file_budget(4320, 2**20) == 4320
    assert open_file_budget(400, 3) == 1
    lengths = [[5, 6, 7]] * 5
    write_id_shards(tmp_path, lengths)
    index = LengthIndex.scan(tmp_path)
    ids = np.array([14, 0, 7, 3, 12, 1, 9])  # touches every shard, out of order
    bounded, whole = SampleReader(index, max_open=2), SampleReader(index)
    assert whole.max_open == 5  # this machine's limit allows all five
    for reader in (bounded, whole):
        got = [int(s.masked_labels[0]) for s in reader.read(ids)]
        assert got == ids.tolist()
    assert len(bounded._open) == 2 and len(whole._open) == 5
    bounded.close(), whole.close()


def test_index_refuses_a_sample_without_tokens(tmp_path):
    from bert.batch import Sample
    from bert.data.format import write_varlength_shard
    from bert.data.index import LengthIndex

    write_id_shards(tmp_path, [[5, 6]])
    empty = np.zeros(0, np.int64)
    hollow = Sample(empty, empty, empty, empty, 0)
    write_varlength_shard(tmp_path / "part_00001_of_00002.hdf5", [id_sample(2, 4), hollow])
    with pytest.raises(ShardError, match="part_00001_of_00002.hdf5: a sample has 0 tokens"):
        LengthIndex.scan(tmp_path)


def test_index_locates_ids_across_empty_shards_and_the_reader_checks_rows_against_it(tmp_path):
    from bert.data.index import LengthIndex
    from bert.data.reader import SampleReader

    paths = write_id_shards(tmp_path, [[5, 6], [], [7, 8, 9]])  # ids 0 1 | - | 2 3 4
    index = LengthIndex.scan(tmp_path)
    shard, row = index.locate(np.array([0, 1, 2, 3, 4]))
    assert shard.tolist() == [0, 0, 2, 2, 2] and row.tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(IndexError):
        index.locate(np.array([5]))
    # An index that disagrees with the rows (a shard rewritten after the scan) is caught, whichever way it is off.
    for wrong in ([5, 6], [7, 9, 9]), ([5, 6], [7, 7, 9]):
        reader = SampleReader(LengthIndex.from_lengths(paths, [np.array(wrong[0]), np.zeros(0), np.array(wrong[1])]))
        assert [len(s.input_ids) for s in reader.read(np.array([0, 1, 2]))] == [5, 6, 7]
        with pytest.raises(ShardError, match=r"row 1 has 8 tokens, the length index says [79]"):
            reader.read(np.array([3]))
        reader.close()


def test_prefetcher_refuses_a_depth_below_one():
    # Queue(maxsize=0) is unbounded: a depth of 0 would let the thread read the whole data set ahead.
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Prefetcher(lambda step: collate([id_sample(step, 5)]), start=0, depth=0, pin=False)
