"""One pre-training example as a shard stores it: numpy arrays, no torch.

Apart from `bert.batch` (which collates samples into torch tensors) so that the data tools, which read and write
shards but never train, start without importing torch (about 2 s of CPU each; `tests/test_data_tools.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Sample(NamedTuple):
    """One pre-training example as stored in a varlength shard (positions are per sequence)."""

    input_ids: np.ndarray  # (L,) token ids, [CLS] A [SEP] B [SEP]
    segment_ids: np.ndarray  # (L,)
    masked_positions: np.ndarray  # (m,) positions inside this sequence
    masked_labels: np.ndarray  # (m,)
    nsp_label: int
