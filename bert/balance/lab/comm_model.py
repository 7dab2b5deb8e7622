"""An α-β model of gradient reduction: flat ring allreduce vs hierarchical vs parameter server.

Nothing here communicates and nothing imports torch; `bench/comm.py` prints and plots it next to
measured gloo runs, and `tests/test_comm_model.py` checks it against Herring's own numbers.

Herring [003] §IV gives the terms, for n bytes over p ranks (α: per message, β: per byte sent,
γ: per byte summed):
    reduce-scatter   lg(p)·α + (p−1)·(n/p)·β + (p−1)·(n/p)·γ
    all-gather       lg(p)·α + (p−1)·(n/p)·β                       (`modelled_all_gather_seconds`)
    allreduce        the two (Rabenseifner); a ring has the same β and γ terms and 2(p−1)·α
    Herring's PS     p·α + γ + n·β: segments are pipelined, so send, sum and return overlap and the
                     bytes cross each worker's link once each way; naive (unpipelined) PS
                     2α + 2(n−1)·β + n·p·γ.
Strategies over a cluster of G GPUs in nodes of g (N = G/g nodes):
    flat          one ring over all G GPUs, topology-unaware: each GPU's 2(G−1)/G·n ring bytes go
                  over its share of the node's network links (the Herring §I view of a worker).
    hierarchical  reduce-scatter inside the node (NVLink), ring allreduce of the 1/g shard among the
                  N same-local-rank peers (network), all-gather inside the node: Herring §III-A steps
                  1, 5 and 6 around an allreduce; TPU [004] §3.3 does the same on the torus's two axes.
    ps            Herring's workflow (§III-A): intra-node reduce-scatter, each GPU's 1/g shard to
                  dedicated server nodes (as many as worker nodes, same bandwidth) and back, pipelined,
                  then the intra-node all-gather.
A name with "bf16" or "fp16" in it (a compressed variant) moves 2-byte elements instead of 4.

Caveat on `flat`: NCCL's rings on DGX nodes are laid out node by node, one per NIC, and cross each
node boundary once per ring, so in practice NCCL's flat allreduce already moves about as few
network bytes per node as the hierarchical one; what hierarchy then saves is the latency term
(2(N−1) network steps instead of 2(G−1)). The per-GPU byte count here is the topology-unaware one.
Link figures are the vendors' published peaks (one direction, per GPU); α and γ are assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bert.balance.lab.exchange_model import INFINIBAND, NVLINK, Link, modelled_all_gather_seconds


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra: Link  # inside a node, per GPU and direction
    inter: Link  # between nodes: each GPU's share of the node's NICs, per direction
    gamma: float  # seconds per byte summed


# [NVIDIA-DGX]: A100 SXM NVLink3 600 GB/s total (300 GB/s each way); DGX A100 has 8 ConnectX-6 HDR 200 Gb/s
# InfiniBand NICs for compute, one per GPU (25 GB/s); HBM2e ~2.0 TB/s. H100 SXM NVLink4 900 GB/s total
# (450 each way); DGX H100 has 8 ConnectX-7 NDR 400 Gb/s ports (50 GB/s per GPU); HBM3 3.35 TB/s.
# A sum reads two bytes and writes one: γ = 3 / HBM bandwidth. α: the lab's assumed latencies.
A100 = Cluster("DGX A100 (NVLink3 + 8x HDR IB)", 8, Link("NVLink3", NVLINK.alpha, 300e9),
               Link("HDR 200 Gb/s", INFINIBAND.alpha, 25e9), gamma=3 / 2.0e12)
H100 = Cluster("DGX H100 (NVLink4 + 8x NDR IB)", 8, Link("NVLink4", NVLINK.alpha, 450e9),
               Link("NDR 400 Gb/s", INFINIBAND.alpha, 50e9), gamma=3 / 3.35e12)
CLUSTERS = {"A100": A100, "H100": H100}
STRATEGIES = ("flat", "hierarchical", "ps")


def reduce_scatter_seconds(n: float, p: int, link: Link, gamma: float) -> float:
    """lg(p)·α + (p−1)·(n/p)·β + (p−1)·(n/p)·γ (Herring [003] §IV)."""
    if p <= 1:
        return 0.0
    return math.log2(p) * link.alpha + (p - 1) * n / p * (1 / link.bandwidth + gamma)


def rabenseifner_allreduce_seconds(n: float, p: int, link: Link, gamma: float) -> float:
    """2·lg(p)·α + 2(p−1)·(n/p)·β + (p−1)·(n/p)·γ: reduce-scatter then all-gather (Herring [003] §IV)."""
    return reduce_scatter_seconds(n, p, link, gamma) + modelled_all_gather_seconds(n, p, link)


def ring_allreduce_seconds(n: float, p: int, link: Link, gamma: float) -> float:
    """2(p−1)·α + 2(p−1)·(n/p)·β + (p−1)·(n/p)·γ: the same bytes in 2(p−1) neighbour steps."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) * n / p / link.bandwidth + (p - 1) * n / p * gamma


def herring_ps_seconds(n: float, workers: int, link: Link, gamma: float, segment: int = 9000) -> float:
    """p·α + γ + n·β (Herring [003] §IV), γ the sum of one jumbo-frame segment from each worker."""
    return workers * link.alpha + segment * workers * gamma + n / link.bandwidth


def naive_ps_seconds(n: float, workers: int, link: Link, gamma: float) -> float:
    """2α + 2(n−1)·β + n·p·γ: send, sum, return one after another (Herring [003] §IV)."""
    return 2 * link.alpha + 2 * (n - 1) / link.bandwidth + n * workers * gamma


def ring_bytes_sent(n: float, p: int) -> float:
    """Bytes each rank sends in a ring (or Rabenseifner) allreduce: 2(p−1)/p·n."""
    return 2 * (p - 1) * n / p


def traditional_ps_server_bytes(variable_bytes: float, workers: int) -> float:
    """What the server holding one whole variable receives (and sends) per step: every worker's copy."""
    return variable_bytes * workers


def herring_server_bytes(buffer_bytes: float, workers: int, servers: int) -> float:
    """What one Herring server receives (and sends) per fusion buffer: its 1/N_s shard from each of N_w
    workers, (1/N_s)·N_w of the buffer (Herring [003] §IV-B)."""
    return buffer_bytes * workers / servers


@dataclass(frozen=True)
class Prediction:
    seconds: float
    inter_bytes_per_gpu: float  # sent over the network by one GPU (it receives as many)
    bytes_per_gpu: float  # sent over any link by one GPU


def base_strategy(name: str) -> str:
    """The modelled family of a reduction's registry name: `hierarchical*`, `ps*`, else `flat`."""
    return "hierarchical" if name.startswith("hier") else "ps" if name.startswith("ps") else "flat"


def element_bytes(name: str, default: int = 4) -> int:
    return 2 if "bf16" in name or "fp16" in name else default


def predict(strategy: str, params: int, gpus: int, cluster: Cluster, dtype_bytes: int = 4) -> Prediction:
    """Modelled time and bytes of one reduction of `params` gradients over `gpus` GPUs."""
    n = params * element_bytes(strategy, dtype_bytes)
    g = min(cluster.gpus_per_node, gpus)
    nodes = math.ceil(gpus / g)
    family = base_strategy(strategy)
    if family == "flat" or nodes == 1:
        link = cluster.intra if nodes == 1 else cluster.inter
        sent = ring_bytes_sent(n, gpus)
        return Prediction(ring_allreduce_seconds(n, gpus, link, cluster.gamma), sent if nodes > 1 else 0.0, sent)
    intra = (reduce_scatter_seconds(n, g, cluster.intra, cluster.gamma)
             + modelled_all_gather_seconds(n, g, cluster.intra))
    intra_bytes = 2 * (g - 1) * n / g  # reduce-scatter and all-gather, each (g−1)/g·n
    if family == "hierarchical":
        inter = ring_allreduce_seconds(n / g, nodes, cluster.inter, cluster.gamma)
        inter_bytes = ring_bytes_sent(n / g, nodes)
    else:  # ps: the shard goes to the servers once and comes back once
        inter = herring_ps_seconds(n / g, nodes, cluster.inter, cluster.gamma)
        inter_bytes = n / g
    return Prediction(intra + inter, inter_bytes, intra_bytes + inter_bytes)
