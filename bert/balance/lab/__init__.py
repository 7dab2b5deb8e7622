"""The lab: offline studies and cost models behind the benchmarks, used by `bench/` and `tests/` only.

Training never imports this package (`tests/test_balance_lab.py` checks it); the strategies it
studies are the product's own (`bert.balance.get_strategy`).

    length_pmf      a sequence-length distribution as a probability per length
    simulate        per-GPU token spread of each strategy over many draws (Samsung [000] §5.2, Table 5 in App. C.2)
    packing         best-fit packing of a length histogram, the alternative NVIDIA ships ([Krell-Packing])
    exchange_model  α-β *model* of the all-gathers the papers run to balance; nothing here communicates
    comm_model      α-β *model* of the gradient reductions of `bert.dist` (flat ring, hierarchical, Herring's
                    parameter server) on DGX A100 / H100 links (Herring [003] §IV)
"""
