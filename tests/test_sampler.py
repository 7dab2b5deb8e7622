"""The global plan: shuffle buffer, file dealing, epoch layout, strata, determinism (no files needed)."""

from pathlib import Path

import numpy as np
import pytest

from bert.balance import STRATEGIES
from bert.data.epoch import lay_out_epoch
from bert.data.index import LengthIndex
from bert.data.plan import TrainPlan
from bert.data.shuffle import buffer_order, shuffle_buffer_order
from bert.data.streams import rank_streams
from bert.lengths import WIKI_PHASE2

EDGES = (128, 256, 384, 512)


def sequential_buffer(n: int, size: int, slots: np.ndarray, drain: np.ndarray) -> list[int]:
    """tf.data.shuffle written out element by element."""
    buffer, out = list(range(size)), []
    for k, slot in enumerate(slots):
        out.append(buffer[slot])
        buffer[slot] = size + k
    return out + [buffer[j] for j in drain]


@pytest.mark.parametrize("n,size", [(200, 7), (50, 1), (30, 30), (1, 1), (500, 64)])
def test_shuffle_buffer_matches_sequential_reference(n, size):
    rng = np.random.default_rng(n + size)
    slots, drain = rng.integers(0, size, n - size), rng.permutation(size)
    assert buffer_order(slots, drain).tolist() == sequential_buffer(n, size, slots, drain)


def test_shuffle_buffer_limits():
    rng = np.random.default_rng(0)
    assert shuffle_buffer_order(20, 1, rng).tolist() == list(range(20))  # a buffer of one cannot reorder
    order = shuffle_buffer_order(1000, 10, rng)
    assert sorted(order) == list(range(1000))
    # A sample leaves at most `size` draws... it cannot come out before it went in: position >= id - size.
    assert (np.arange(1000) >= order - 10).all()
    assert shuffle_buffer_order(0, 5, rng).size == 0
    with pytest.raises(ValueError):
        shuffle_buffer_order(5, 0, rng)


def fake_index(sizes: list[int], seed: int = 0, lengths=None) -> LengthIndex:
    rng = np.random.default_rng(seed)
    per_shard = [WIKI_PHASE2.sample(n, rng) if lengths is None else np.asarray(lengths[i]) for i, n in enumerate(sizes)]
    return LengthIndex.from_lengths([Path(f"shard{i}.hdf5") for i in range(len(sizes))], per_shard)


def test_files_dealt_like_nvidia():
    sizes = [10 + i for i in range(12)]
    index = fake_index(sizes)
    world, seed, epoch = 4, 3, 1
    streams = rank_streams(index, world, seed, epoch, shuffle_buffer=1)  # buffer 1: file order kept
    # NVIDIA: files[(f_id * world_size + rank) % num_files] over the list shuffled by the epoch's seed.
    files = np.random.default_rng([seed, epoch, 0]).permutation(12)
    for rank in range(world):
        mine = [files[(f_id * world + rank) % 12] for f_id in range(12 // world)]
        expected = np.concatenate([np.arange(index.offsets[f], index.offsets[f + 1]) for f in mine])
        assert streams[rank].tolist() == expected.tolist()
    assert rank_streams(index, world, seed, epoch + 1, 1)[0].tolist() != streams[0].tolist()


def test_fewer_shards_than_ranks_are_split_so_every_rank_draws():
    index = fake_index([40, 37])
    streams = rank_streams(index, 8, 0, 0, shuffle_buffer=16)
    assert all(len(s) >= 9 for s in streams)
    assert sorted(np.concatenate(streams)) == list(range(77))


def test_epoch_layout_by_hand():
    a, b = np.array([10, 11, 12, 13, 14]), np.array([20, 21, 22])
    rng = np.random.default_rng(0)
    # W=2, L=2, epoch starts 1 position into a step: rank 0 owes 1 id, rank 1 owes 2 (the head).
    order = lay_out_epoch([a, b], local_batch=2, offset=1, rng=rng)
    assert order[:3].tolist() == [10, 20, 21]
    # Body: chunks of 2 by (chunk, rank): [11 12] [22] [13 14] -> one whole step [11 12 | 22 13].
    assert order[3:7].tolist() == [11, 12, 22, 13] and order[7:].tolist() == [14]
    order = lay_out_epoch([a, b[:2]], local_batch=2, offset=0, rng=rng)
    assert order[:4].tolist() == [10, 11, 20, 21] and sorted(order[4:].tolist()) == [12, 13, 14]


def test_stratified_layout_by_hand():
    # Ids 0..5 are stratum 0, 6..11 stratum 1; a local batch of 2 takes one of each.
    strata = np.repeat([0, 1], 6)
    a, b = np.array([0, 1, 2, 3, 6, 7, 8, 9]), np.array([4, 10])
    order = lay_out_epoch([a, b], 2, 0, np.random.default_rng(0), strata, (1, 1))
    # Step 0: each rank its first id of each stratum. Rank 1 is then empty, so in step 1 rank 0's
    # next chunks move up into row 1: stratum 0 runs [0 4 1 2 3], stratum 1 [6 10 7 8 9].
    assert order[:8].tolist() == [0, 6, 4, 10, 1, 7, 2, 8]
    assert sorted(order[8:].tolist()) == [3, 9]  # one id per stratum left: less than a step, tail
    with pytest.raises(ValueError, match="sum"):
        lay_out_epoch([a, b], 2, 0, np.random.default_rng(0), strata, (1, 2))
    # A stratum too rare for a count of its own (counts 2/0) is all tail.
    order = lay_out_epoch([np.array([0, 1, 6, 7]), np.array([2, 3, 8])], 2, 0, np.random.default_rng(0), strata, (2, 0))
    assert order[:4].tolist() == [0, 1, 2, 3] and sorted(order[4:].tolist()) == [6, 7, 8]


def plan_for(strategy: str, seed: int = 0, index: LengthIndex | None = None) -> TrainPlan:
    index = index or fake_index([70, 55, 90, 64, 81, 47])  # 407 samples: not a multiple of 4 x 8
    return TrainPlan(index, world_size=4, local_batch_size=8, ranks_per_node=2, strategy=strategy, seed=seed,
                     shuffle_buffer=32)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_sample_exactly_once_per_epoch(strategy):
    plan = plan_for(strategy)
    n, gbs = plan.index.num_samples, plan.global_batch_size
    steps = 3 * n // gbs + 1
    drawn = np.concatenate([plan.draw(t).ravel() for t in range(steps)])
    for e in range(3):
        assert np.sort(drawn[e * n : (e + 1) * n]).tolist() == list(range(n)), f"epoch {e}"
    for t in range(steps):
        trained = plan.assignment(t)
        assert trained.shape == (4, 8)
        assert np.sort(trained.ravel()).tolist() == np.sort(plan.draw(t).ravel()).tolist()
        if STRATEGIES[strategy].scope != "world":  # node-local balancing never crosses a node
            for node in range(2):
                rows = slice(2 * node, 2 * node + 2)
                assert set(trained[rows].ravel()) == set(plan.draw(t)[rows].ravel())


def row_strata(lengths: np.ndarray) -> list[int]:
    return [int(((lengths > lo) & (lengths <= hi)).sum()) for lo, hi in zip((0,) + EDGES[:-1], EDGES)]


def test_stratified_steps_have_exact_counts_until_a_stratum_runs_out():
    index = fake_index([300, 280, 320, 260, 310, 290, 305, 275])
    plan = TrainPlan(index, 4, 16, 2, "samsung", seed=1, shuffle_buffer=100)
    have = np.array(row_strata(index.lengths))
    assert sum(plan.counts) == 16 and np.abs(np.array(plan.counts) - 16 * have / index.num_samples).max() < 1
    # Independently: the stratified steps last until the scarcest stratum (relative to its
    # count) is used up world-wide, and ranks draw from their own shards until one rank's
    # scarcest stratum is used up.
    body = min(h // (4 * c) for h, c in zip(have, plan.counts) if c)
    streams = rank_streams(index, 4, 1, 0, 100)
    own = min(h // c for s in streams for h, c in zip(row_strata(index.lengths[s]), plan.counts) if c)
    assert 0 < own < body < index.num_samples // 64
    for t in range(body):
        draw = plan.draw(t)
        for rank in range(4):
            assert row_strata(index.lengths[draw[rank]]) == list(plan.counts), (t, rank)
            assert t >= own or set(draw[rank]) <= set(streams[rank])
    tail_steps = range(body, index.num_samples // 64)
    assert any(row_strata(index.lengths[plan.draw(t)[r]]) != list(plan.counts) for t in tail_steps for r in range(4))
    # The next epoch's first whole step is stratified again.
    first = -(-index.num_samples // 64)
    assert all(row_strata(index.lengths[plan.draw(first)[r]]) == list(plan.counts) for r in range(4))
    # ... and its ranks read their own shards again, from the part of the step that straddles the two epochs on:
    # the epoch is laid out from the position in a step where it starts. (Exact counts alone cannot show that:
    # any L consecutive ids of rows laid out alike hold the counts.)
    streams1 = rank_streams(index, 4, 1, 1, 100)
    straddling, offset = divmod(index.num_samples, 64)
    assert offset and index.num_samples % 16  # the epoch starts inside a rank's row
    for t in (straddling, first, first + 1):
        for rank in range(4) if t > straddling else range(offset // 16, 4):  # the rows with epoch-1 ids
            position = t * 64 + rank * 16 + np.arange(16)  # in the stream of epochs
            new = plan.draw(t)[rank][position >= index.num_samples]
            assert len(new) and set(new) <= set(streams1[rank]), (t, rank)


def test_uneven_shards_cost_no_steps():
    # Ranks get 300 + 20 samples vs 30 + 25: the short ranks' rows are filled from the long ranks'
    # chunks, so only the last partial step's worth (< 4 x 8) is left for the tail.
    plan = TrainPlan(fake_index([300, 30, 20, 25]), 4, 8, 2, "none", seed=0, shuffle_buffer=1)
    streams = rank_streams(plan.index, 4, 0, 0, 1)
    assert sorted(len(s) for s in streams) == [20, 25, 30, 300]
    steps = 375 // 32
    drawn = np.concatenate([plan.draw(t).ravel() for t in range(steps)])
    assert len(set(drawn)) == steps * 32
    longest = int(np.argmax([len(s) for s in streams]))
    assert plan.draw(0)[longest].tolist() == streams[longest][:8].tolist()  # step 0: own stream
    # From chunk 4 on only the long rank has ids; its last 375 - 11 * 32 = 23 are the tail.
    assert plan.draw(steps - 1).ravel().tolist() == streams[longest][-55:-23].tolist()
    assert sorted(plan.epoch(0)[steps * 32 :]) == sorted(streams[longest][-23:])


def test_same_seed_same_plan_other_seed_other_plan():
    a, b, c = plan_for("samsung", 5), plan_for("samsung", 5), plan_for("samsung", 6)
    steps = range(0, 30, 3)
    assert all((a.assignment(t) == b.assignment(t)).all() for t in steps)
    assert any((a.draw(t) != c.draw(t)).any() for t in steps)
    # Jumping straight to a late step gives what stepping there gives (resume relies on it).
    assert (plan_for("samsung", 5).draw(29) == a.draw(29)).all()


def test_plan_rejects_bad_settings():
    index = fake_index([20])
    with pytest.raises(ValueError, match="multiple"):
        TrainPlan(index, 6, 4, 4)
    with pytest.raises(ValueError, match="unknown balance strategy"):
        TrainPlan(index, 4, 4, 2, "fastest")
    long = fake_index([3], lengths=[[100, 600, 50]])
    with pytest.raises(ValueError, match=r"shard0.hdf5: sample 1 has 600 tokens"):
        TrainPlan(long, 1, 1, 1, "stratified")


@pytest.mark.parametrize("strategy", sorted(name for name, s in STRATEGIES.items() if s.stratified))
def test_a_local_batch_that_draws_nothing_from_a_stratum_is_refused(strategy):
    """Rounded to a local batch of 4, Wikipedia's (256,384] stratum (11.7 %) gets 0 of 4: its sequences would wait
    for the epoch's tail and a run would never train on them. 5 is the smallest batch that draws from all four."""
    lengths = np.repeat([100, 200, 300, 500], [373, 197, 117, 313])  # the phase-2 mix, 1,000 samples
    index = fake_index([1000], lengths=[lengths])
    with pytest.raises(ValueError, match=rf"BALANCE={strategy} with a local batch of 4 draws no sequence of length "
                                         r"\(256,384\] \(11\.7 % of the samples\).*at least 5 "):
        TrainPlan(index, 2, 4, 2, strategy)
    assert TrainPlan(index, 2, 5, 2, strategy).counts == (2, 1, 1, 1)
    assert TrainPlan(index, 2, 4, 2, "none").counts is None  # unstratified draws keep the data's mix on average


def test_epoch_ids_and_lengths_are_int32():
    """Every rank holds the epoch's layout: phase 2's 156.7 M ids take 0.63 GB as int32 against 1.25 as int64."""
    from bert.data.streams import id_dtype

    index = fake_index([300, 200, 250])
    assert index.lengths.dtype == np.int32  # the length index too: 0.63 GB for phase 2 against 1.25
    for strategy in ("none", "samsung"):
        plan = TrainPlan(index, 4, 8, 2, strategy, seed=1, shuffle_buffer=20)
        assert plan.epoch(0).dtype == np.int32 and plan.draw(100).dtype == np.int32
        assert sorted(plan.epoch(1).tolist()) == list(range(750))
    assert id_dtype(2**31 - 1) == np.int32 and id_dtype(2**31) == np.int64


def test_a_rare_stratum_names_a_batch_that_draws_it_without_searching_every_size():
    """Three sequences of 257-384 tokens among 3 x 10^8: a batch of 10^8 draws one; the search stops early."""
    from bert.data.plan import check_every_stratum_drawn

    present = np.array([10**8, 10**8, 3, 10**8])
    with pytest.raises(ValueError, match=r"\(256,384\] \(1e-06 % of the samples\).*at least 100000001 "):
        check_every_stratum_drawn(present, (6, 5, 0, 5), "samsung", 16)
