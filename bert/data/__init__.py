"""Data: shard formats (`format`), the data set's manifest (`manifest`) and the online training input pipeline.

Pipeline modules, in the order a batch flows through them:

    index     length index of all shards; global sample id = (shard, row)
    shuffle   shuffle buffer (TPU [004] §3.5), computed in bulk
    streams   per epoch: shards dealt to ranks NVIDIA-style, one shuffle buffer per rank
    epoch     one epoch as global batches: head, (stratified) body, tail; exactly once
    plan      the step -> (world, local_batch) draw and its balancing assignment, same on all ranks
    reader    samples by global id, bounded set of open shards
    prefetch  background thread: plan, read, collate, pin
    pipeline  TrainLoader (the training iterator) and EvalSet (from eval_set: read at its first use)
"""
