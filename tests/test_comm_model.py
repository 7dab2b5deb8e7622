"""The α-β model of gradient reduction (bert/balance/lab/comm_model.py) against Herring's own numbers.

Quoted from Herring [003]:
  §IV-A   "when 100 MB is all-reduced across 64 nodes, data transferred is 2 * 63 * 100/64 = 196.8 MB";
          "Herring is able to average gradients in half the time NCCL takes because each node sends and
          receives only half as much data compared to NCCL".
  §I      ring allreduce: "transmitting and receiving 2M bytes for a model size M ... compared to 2 hops
          and M bytes in the case of parameter server".
  Table II  the gradients of the last 10 ms of BERT-large's backward (fp16), the largest the 31260672-
          element word embedding (61056 KB); the balanced fusion buffer over them "would be 86684 KB".
  Table III data sent/received per iteration by the server holding parameter0: traditional PS
          477 / 954 / 1908 / 3816 (MB) for 8 / 16 / 32 / 64 workers; Herring 84.6 at every size.
  §IV-C   "With 340 million model parameters, at each step BERT requires 680MB gradient update with fp16
          communication."
And the issue's acceptance: at 1024 GPUs hierarchical moves node-size times fewer network bytes per GPU.
"""

from __future__ import annotations

import pytest

from bert.balance.lab.comm_model import (
    A100,
    CLUSTERS,
    STRATEGIES,
    Link,
    herring_ps_seconds,
    herring_server_bytes,
    naive_ps_seconds,
    predict,
    rabenseifner_allreduce_seconds,
    ring_allreduce_seconds,
    ring_bytes_sent,
    traditional_ps_server_bytes,
)
from bert.model.config import NAMED

BANDWIDTH_ONLY = Link("β only", alpha=0.0, bandwidth=12.5e9)  # 100 Gb/s EFA, no latency
TABLE_II_LENGTHS = [4194304, 4096, 4194304, 1024, 1024, 1024, 1048576, 1024, 1048576, 1024, 1048576, 1024,
                    1048576, 1024, 1024, 2048, 524288, 31260672]  # fmt: skip
TABLE_II_KB = [8192, 8, 8192, 2, 2, 2, 2048, 2, 2048, 2, 2048, 2, 2048, 2, 2, 4, 1024, 61056]


def test_ring_bytes_of_100mb_over_64_nodes():
    assert ring_bytes_sent(100, 64) == pytest.approx(196.8, abs=0.1)  # the paper truncates 196.875


def test_parameter_server_moves_half_of_allreduce():
    n, p = 100e6, 64
    ring = rabenseifner_allreduce_seconds(n, p, BANDWIDTH_ONLY, gamma=0.0)
    ps = herring_ps_seconds(n, p, BANDWIDTH_ONLY, gamma=0.0)
    assert ring / ps == pytest.approx(2 * 63 / 64)  # "half the time"
    assert ring_allreduce_seconds(n, p, BANDWIDTH_ONLY, 0.0) == pytest.approx(ring)  # same β term as a ring
    # Pipelining is what makes the PS cheap: the naive order sends every byte twice in sequence.
    assert naive_ps_seconds(n, p, BANDWIDTH_ONLY, 0.0) == pytest.approx(2 * ps, rel=1e-6)
    # and ~M vs ~2M bytes per worker (§I)
    assert predict("ps", 10**8, 512, A100).inter_bytes_per_gpu * 8 == pytest.approx(4e8)


def test_table_ii_is_bert_large_and_its_balanced_buffer_is_86684_kb():
    large = NAMED["large"]
    h, v = large.hidden_size, large.vocab_size
    assert {v * h, large.intermediate_size * h, large.intermediate_size, h * h, h, large.max_position_embeddings * h,
            2 * h} == set(
        TABLE_II_LENGTHS)  # the same tensors our BERT-large has (vocab padded to 30528)
    assert [n * 2 // 1024 for n in TABLE_II_LENGTHS] == TABLE_II_KB  # fp16
    assert sum(TABLE_II_KB) == 86684


@pytest.mark.parametrize("workers, traditional_mb", [(8, 477), (16, 954), (32, 1908), (64, 3816)])
def test_table_iii_server_load(workers: int, traditional_mb: int):
    assert traditional_ps_server_bytes(61056, workers) / 1024 == pytest.approx(traditional_mb, abs=0.5)
    assert herring_server_bytes(86684, workers, servers=workers) / 1024 == pytest.approx(84.6, abs=0.1)


def test_fp16_gradient_update_of_bert_large_is_680_mb():
    p = predict("flat_fp16", 340_000_000, 8, A100)
    assert p.bytes_per_gpu == pytest.approx(2 * 7 / 8 * 680e6)  # 680 MB on the ring, 2(p-1)/p of it sent


@pytest.mark.parametrize("cluster", list(CLUSTERS))
def test_hierarchical_moves_node_size_fewer_network_bytes_at_1024_gpus(cluster: str):
    c = CLUSTERS[cluster]
    flat, hier = (predict(s, 336_000_000, 1024, c) for s in ("flat", "hierarchical"))
    ratio = flat.inter_bytes_per_gpu / hier.inter_bytes_per_gpu
    assert c.gpus_per_node <= ratio < c.gpus_per_node * 1.01  # 8 x (1023/1024)/(127/128)
    assert hier.seconds < flat.seconds
    # In one node there is no network, and every strategy is the same ring over NVLink.
    one_node = {predict(s, 336_000_000, 8, c) for s in STRATEGIES}
    assert len(one_node) == 1 and next(iter(one_node)).inter_bytes_per_gpu == 0.0


# α = 1 s, β = 1 s/byte and γ = 0.5 s/byte: every term of Herring [003] §IV shows in the total.
UNIT = Link("unit", alpha=1.0, bandwidth=1.0)


def test_each_term_of_herrings_formulas_by_hand():
    from bert.balance.lab.comm_model import reduce_scatter_seconds

    n, p, gamma = 8.0, 4, 0.5  # n/p = 2 bytes per rank and step
    # reduce-scatter: lg(4)·α + 3·2·β + 3·2·γ = 2 + 6 + 3
    assert reduce_scatter_seconds(n, p, UNIT, gamma) == pytest.approx(11.0)
    # Rabenseifner: 2·lg(4)·α + 2·3·2·β + 3·2·γ = 4 + 12 + 3
    assert rabenseifner_allreduce_seconds(n, p, UNIT, gamma) == pytest.approx(19.0)
    # ring: the same β and γ terms, 2(p−1) = 6 neighbour steps of α
    assert ring_allreduce_seconds(n, p, UNIT, gamma) == pytest.approx(6 + 12 + 3)
    # naive PS: 2α + 2(n−1)·β + n·p·γ = 2 + 14 + 16
    assert naive_ps_seconds(n, p, UNIT, gamma) == pytest.approx(32.0)
    # Herring: p·α + γ (one 2-byte segment from each of 4 workers summed) + n·β = 4 + 4 + 8
    assert herring_ps_seconds(n, p, UNIT, gamma, segment=2) == pytest.approx(16.0)


def test_herring_server_load_with_fewer_servers_than_workers():
    # §IV-B: each server sends and receives (1/N_s)·N_w of the 86684 KB buffer: 64 workers on 16 servers, 4 buffers.
    assert herring_server_bytes(86684, workers=64, servers=16) == pytest.approx(4 * 86684)


def test_hierarchical_over_two_dgx_a100_by_hand():
    n = 4 * 10**8  # 10^8 fp32 gradients
    # DGX A100 as the module's docstring gives it: NVLink3 2 us, 300 GB/s; HDR 6 us, 25 GB/s; γ = 3 / 2 TB/s.
    a_nv, b_nv, a_ib, b_ib, gamma = 2e-6, 300e9, 6e-6, 25e9, 3 / 2.0e12
    reduce_scatter = 3 * a_nv + 7 / 8 * n * (1 / b_nv + gamma)  # 8 GPUs on NVLink
    all_gather = 3 * a_nv + 7 / 8 * n / b_nv
    shard = n / 8  # each GPU's eighth, ring-allreduced with its one peer in the other node
    across = 2 * a_ib + 2 * (shard / 2) / b_ib + (shard / 2) * gamma
    got = predict("hierarchical", 10**8, 16, A100)
    assert got.seconds == pytest.approx(reduce_scatter + all_gather + across, rel=1e-12)
    assert got.inter_bytes_per_gpu == pytest.approx(shard)  # 2(2−1)/2 of the shard
    assert got.bytes_per_gpu == pytest.approx(2 * 7 / 8 * n + shard)  # plus 7/8 of n each way inside the node


def test_a_partial_second_node_still_crosses_the_network():
    # 12 GPUs at 8 per node are two nodes: every strategy sends over InfiniBand.
    n = 4 * 10**8
    assert predict("flat", 10**8, 12, A100).inter_bytes_per_gpu == pytest.approx(2 * 11 / 12 * n)
    assert predict("hierarchical", 10**8, 12, A100).inter_bytes_per_gpu == pytest.approx(n / 8)
