import numpy as np
import pytest
import torch

from bert.batch import Sample, SeqLayout, collate
from bert.lengths import WIKI_PHASE2, histogram
from bert.synthetic import random_batch


def test_collate_offsets_positions_and_masks():
    a = Sample(np.array([101, 5, 102]), np.array([0, 0, 0]), np.array([1]), np.array([7]), 0)
    b = Sample(np.array([101, 6, 8, 102]), np.array([0, 0, 1, 1]), np.array([1, 2]), np.array([9, 10]), 1)
    batch = collate([a, b])
    assert batch.seq.cu_seqlens.tolist() == [0, 3, 7]
    assert batch.seq.cu_seqlens.dtype == torch.int32
    assert batch.seq.max_seqlen == 4 and batch.seq.lengths == (3, 4)
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert batch.masked_positions.tolist() == [1, 4, 5]  # offsets into the token axis
    assert batch.input_ids[batch.masked_positions].tolist() == [5, 6, 8]
    assert batch.nsp_labels.tolist() == [0, 1]


def test_collate_rejects_bad_samples():
    bad = Sample(np.array([101, 5]), np.array([0, 0]), np.array([2]), np.array([7]), 0)
    with pytest.raises(ValueError, match="outside"):
        collate([bad])
    with pytest.raises(ValueError):
        SeqLayout.from_lengths([3, 0])
    # The check is per sequence, not on the token axis: position 3 of a 3-token sequence is outside it even
    # though the batch has a token 3.
    good = Sample(np.array([101, 5, 102]), np.array([0, 0, 0]), np.array([1]), np.array([7]), 0)
    spill = Sample(np.array([101, 5, 102]), np.array([0, 0, 0]), np.array([3]), np.array([7]), 0)
    with pytest.raises(ValueError, match="masked position 3 outside a sequence of 3 tokens"):
        collate([good, spill])
    with pytest.raises(ValueError, match="outside"):
        collate([good, spill._replace(masked_positions=np.array([-1]))])


def test_random_batch_masks_about_15_percent():
    batch = random_batch([1, 512, 100], seed=1)
    assert batch.num_tokens == 613
    assert batch.masked_positions.numel() == 0 + 76 + 15  # a lone [CLS] has nothing to mask
    assert (batch.input_ids[batch.masked_positions] == 103).all()


def test_wiki_mix_matches_paper_shares():
    lengths = WIKI_PHASE2.sample(200_000, np.random.default_rng(0))
    shares = histogram(lengths, WIKI_PHASE2.edges) / len(lengths)
    assert np.allclose(shares, [0.373, 0.197, 0.117, 0.314], atol=0.005)
    assert abs((lengths == 512).mean() - 0.23) < 0.005
    assert lengths.min() >= 1 and lengths.max() == 512


def test_random_samples_are_framed_cls_a_sep_b_sep():
    """Every synthetic sample starts with [CLS], ends with [SEP], has exactly two [SEP]s from length 3 on, and
    masks neither (a split drawn at 1 used to write the first [SEP] over [CLS])."""
    import numpy as np

    from bert.synthetic import CLS, SEP, random_sample

    rng = np.random.default_rng(0)
    for length in range(1, 12):
        for _ in range(50):
            s = random_sample(length, rng)
            ids = np.asarray(s.input_ids)
            assert ids[0] == CLS and (length < 2 or ids[-1] == SEP)
            if length >= 3:
                assert (ids == SEP).sum() == 2
            assert not np.isin(np.asarray(s.masked_positions), np.flatnonzero((ids == CLS) | (ids == SEP))).any()


def test_seq_layout_max_is_the_longest_not_the_last():
    seq = SeqLayout.from_lengths([5, 9, 2])
    assert seq.max_seqlen == 9 and seq.cu_seqlens.tolist() == [0, 5, 14, 16] and seq.num_tokens == 16


def test_collate_rejects_segment_ids_of_the_wrong_length():
    ids = np.array([101, 5, 6, 102])
    for segments in (np.array([0, 0, 1]), np.array([0, 0, 1, 1, 1])):  # one short, one long
        with pytest.raises(ValueError, match="segment_ids"):
            collate([Sample(ids, segments, np.array([1]), np.array([5]), 0)])


def test_length_mix_draws_every_length_with_its_exact_probability():
    """Strata (1, 4] and (4, 8], min_length 2, 10 % of all samples at exactly 8: by hand, P(2) = P(3) = P(4) = 0.5 / 3,
    P(5) = P(6) = P(7) = (0.5 - 0.1) / 3 and P(8) = 0.1 (8 is reached only through the share at the maximum)."""
    from bert.lengths import LengthMix

    n = 60_000
    lengths = LengthMix(edges=(4, 8), probs=(0.5, 0.5), at_max=0.1, min_length=2).sample(n, np.random.default_rng(0))
    want = np.array([0, 0, *[0.5 / 3] * 3, *[0.4 / 3] * 3, 0.1])  # P(length = 0 .. 8)
    got = np.bincount(lengths, minlength=9) / n
    assert got.shape == (9,) and np.abs(got - want).max() < 0.01  # binomial sd <= 0.0016


def test_histogram_strata_include_their_upper_edge_and_refuse_longer_lengths():
    assert histogram([1, 4, 5, 8, 8], (4, 8)).tolist() == [2, 3]
    with pytest.raises(ValueError, match="above the last stratum edge"):
        histogram([3, 9], (4, 8))


def test_random_sample_segments_and_labels():
    """Segment 0 runs up to and including the first [SEP]; the labels are the words the masks replaced (words are
    drawn at or above FIRST_WORD_ID, so no label is a special token)."""
    from bert.synthetic import FIRST_WORD_ID, MASK, SEP, random_sample

    rng = np.random.default_rng(1)
    for length in (3, 4, 17, 128, 512):
        s = random_sample(length, rng)
        first_sep = int(np.flatnonzero(s.input_ids == SEP)[0])
        assert s.segment_ids.tolist() == [0] * (first_sep + 1) + [1] * (length - first_sep - 1)
        assert (s.input_ids[s.masked_positions] == MASK).all()
        assert (s.masked_labels >= FIRST_WORD_ID).all() and (length == 3 or len(s.masked_labels))  # 3: [CLS][SEP][SEP]
