"""An α-β model of the all-gathers the papers run to balance a step; nothing here communicates.

What the papers run: NVIDIA's exchange padding all-gathers every rank's padded batch over the
whole world [NVIDIA-BERT]; Samsung's group exchange padding does the same inside each node
[000] §4.1, [Samsung-BERT]; Baidu overlaps the exchange with training on the CPU [001] §IV-B.

What this harness runs: no exchange at all. Every rank computes the whole step plan, and so
every rank's lengths, from the shared seed and the length index (`bert.data.plan`), then reads
only its own sequences. This module prices, on paper, the traffic that design avoids, for
`bench/balance_cost.py`.

The model: an all-gather of n bytes over p ranks takes lg(p)·α + (p−1)·(n/p)·β (Herring
[003] §IV). A world-wide all-gather is modelled in two levels, the way NCCL would run it on
DGX-class nodes: across nodes between same-local-rank peers (InfiniBand-class links, each GPU
its share of the node's NICs), then inside each node (NVLink-class). The link figures are
assumptions, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# NVIDIA's padded, int16-packed batch ([001] §IV-B-1): input_ids, input_mask, segment_ids,
# masked_lm_labels of max_seq_length each, plus next_sentence_labels.
PADDED_SEQUENCE_BYTES = 2 * (4 * 512 + 1)

# Over which group each strategy's *paper implementation* all-gathers sample data (ours gathers nothing).
PAPER_EXCHANGE_GROUP = {
    "global": "world", "local": "node", "stratified_local": "node", "snake": "node", "samsung": "node",
}  # fmt: skip


@dataclass(frozen=True)
class Link:
    """Assumed parameters of one class of link, per rank."""

    name: str
    alpha: float  # seconds per message (latency)
    bandwidth: float  # bytes per second available to one rank


# Assumed A100 DGX class: NVLink3/NVSwitch ~240 GB/s per GPU in NCCL; Samsung's nodes have four
# HDR InfiniBand links (4 x 25 GB/s) for eight GPUs, 12.5 GB/s per GPU.
NVLINK = Link("NVLink-class", alpha=2e-6, bandwidth=240e9)
INFINIBAND = Link("InfiniBand-class", alpha=6e-6, bandwidth=12.5e9)


def modelled_all_gather_seconds(total_bytes: float, ranks: int, link: Link) -> float:
    """Modelled time of an all-gather of `total_bytes` in all (1/ranks from each): lg(p)·α + (p−1)·(n/p)·β."""
    if ranks <= 1:
        return 0.0
    return math.log2(ranks) * link.alpha + (ranks - 1) * total_bytes / ranks / link.bandwidth


@dataclass(frozen=True)
class ModelledExchange:
    """What one step's balancing would move per rank if run as its paper runs it."""

    group: str  # "none", "node" or "world"
    ranks: int  # ranks in one collective
    collectives: int  # collective calls per step, per rank (NCCL runs the two levels inside one)
    bytes_in: int  # bytes each rank would receive
    seconds: float  # modelled time


def model_paper_exchange(
    strategy: str,
    world: int,
    ranks_per_node: int,
    local_batch: int,
    sequence_bytes: int = PADDED_SEQUENCE_BYTES,
    intra: Link = NVLINK,
    inter: Link = INFINIBAND,
) -> ModelledExchange:
    """The modelled exchange of `strategy`'s paper implementation (none for strategies no paper exchanges for)."""
    group = PAPER_EXCHANGE_GROUP.get(strategy, "none")
    node = min(ranks_per_node, world)
    if group == "none":
        return ModelledExchange("none", 1, 0, 0, 0.0)
    ranks = world if group == "world" else node
    total = ranks * local_batch * sequence_bytes
    nodes = ranks // node
    # Across nodes the same-local-rank peers gather their 1/node of the data, then the node shares it.
    seconds = modelled_all_gather_seconds(total / node, nodes, inter) + modelled_all_gather_seconds(total, node, intra)
    return ModelledExchange(group, ranks, 1, total * (ranks - 1) // ranks, seconds)
