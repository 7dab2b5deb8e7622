"""The load-balance lab: offline studies of the balancing strategies, used by `bench/` and `tests/` only.

Training never imports this package (`tests/test_balance_lab.py` checks it); the strategies it
studies are the product's own (`bert.balance.get_strategy`).

    length_pmf      a sequence-length distribution as a probability per length
    simulate        per-GPU token spread of each strategy over many draws (Samsung [000] §5.2, Table 5 in App. C.2)
    packing         best-fit packing of a length histogram, the alternative NVIDIA ships ([Krell-Packing])
    exchange_model  α-β *model* of the all-gathers the papers run to balance; nothing here communicates
"""
