"""Per-step communication cost of each strategy as its paper runs it (α-β model).

NVIDIA's exchange padding all-gathers every rank's padded batch over the whole world;
Samsung's group exchange padding does the same inside each node; the greedy balancer (and,
in this harness, every strategy: `bert.data.plan`) gathers nothing, because every rank knows
all lengths from the shared length index. The model times an all-gather with paper 003's
formula, lg(p)·α + (p−1)·(n/p)·β, and a world-wide one hierarchically: across nodes
between same-local-rank peers (InfiniBand-class, each GPU its share of the node's NICs),
then inside each node (NVLink-class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# NVIDIA's padded, int16-packed batch (Baidu 001 §IV-B-1): input_ids, input_mask, segment_ids,
# masked_lm_labels of max_seq_length each, plus next_sentence_labels.
PADDED_SEQUENCE_BYTES = 2 * (4 * 512 + 1)

# Which strategies move sample data in their paper's implementation, and over which group.
PAPER_EXCHANGE = {"global": "world", "local": "node", "stratified_local": "node", "snake": "node", "samsung": "node"}


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float  # seconds per message (latency)
    bandwidth: float  # bytes per second available to one rank


# A100 DGX class: NVLink3/NVSwitch ~240 GB/s per GPU in NCCL; Samsung's nodes have four HDR
# InfiniBand links (4 x 25 GB/s) for eight GPUs, 12.5 GB/s per GPU.
NVLINK = Link("NVLink-class", alpha=2e-6, bandwidth=240e9)
INFINIBAND = Link("InfiniBand-class", alpha=6e-6, bandwidth=12.5e9)


def all_gather_seconds(total_bytes: float, ranks: int, link: Link) -> float:
    """All-gather of `total_bytes` in all (each rank contributes 1/ranks): lg(p)·α + (p−1)·(n/p)·β."""
    if ranks <= 1:
        return 0.0
    return math.log2(ranks) * link.alpha + (ranks - 1) * total_bytes / ranks / link.bandwidth


@dataclass(frozen=True)
class Exchange:
    """What one step's balancing moves, per rank."""

    group: str  # "none", "node" or "world"
    ranks: int  # ranks in one collective
    collectives: int  # collective calls per step, per rank (NCCL runs the two levels inside one)
    bytes_in: int  # bytes each rank receives
    seconds: float


def exchange(
    strategy: str,
    world: int,
    ranks_per_node: int,
    local_batch: int,
    sequence_bytes: int = PADDED_SEQUENCE_BYTES,
    intra: Link = NVLINK,
    inter: Link = INFINIBAND,
) -> Exchange:
    group = PAPER_EXCHANGE.get(strategy, "none")
    node = min(ranks_per_node, world)
    if group == "none":
        return Exchange("none", 1, 0, 0, 0.0)
    ranks = world if group == "world" else node
    total = ranks * local_batch * sequence_bytes
    nodes = ranks // node
    # Across nodes the same-local-rank peers gather their 1/node of the data, then the node shares it.
    seconds = all_gather_seconds(total / node, nodes, inter) + all_gather_seconds(total, node, intra)
    return Exchange(group, ranks, 1, total * (ranks - 1) // ranks, seconds)
