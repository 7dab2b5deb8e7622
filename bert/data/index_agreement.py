"""Every rank plans the whole world's batches from its own copy of the length index, so the copies must agree.

On node-local storage (DGX `/raid`) each node has its own copy of the shards; a node missing a shard, or holding a
partial one, computes another plan, and every collective still matches in shape, so the run trains on other
samples than any rank planned, silently. Before anything trains, each rank hashes what the plan reads (shard
names, sizes and every sample's length, train and eval) and the digests are gathered: a rank that disagrees
with rank 0 stops the run, naming the ranks.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from bert.data.index import LengthIndex

SHOWN = 8  # ranks named in the message


def index_digest(*indexes: LengthIndex) -> int:
    """A 63-bit digest of the shard names, shard sizes and sample lengths of `indexes`."""
    h = hashlib.blake2b(digest_size=8)
    for index in indexes:
        h.update("\0".join(p.name for p in index.paths).encode())
        h.update(index.offsets.astype("<i8").tobytes())
        h.update(index.lengths.astype("<i2").tobytes())  # lengths fit int16 (shards store them so)
    return int.from_bytes(h.digest(), "little") >> 1  # non-negative: a signed int64 tensor holds it


def disagreeing_ranks(digests: list[int]) -> list[int]:
    """The ranks whose digest differs from rank 0's."""
    return [r for r, d in enumerate(digests) if d != digests[0]]


def check_index_agreement(device: torch.device, *indexes: LengthIndex) -> None:
    """Raise ValueError on every rank if any rank's `indexes` differ from rank 0's (no-op without a process
    group); one all-gather of an int64 per rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor([index_digest(*indexes)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # the list form: every backend and torch version has it
    digests = torch.cat(every).cpu().tolist()
    odd = disagreeing_ranks(digests)
    if odd:
        names = ", ".join(map(str, odd[:SHOWN])) + (f" and {len(odd) - SHOWN} more" if len(odd) > SHOWN else "")
        where = indexes[0].paths[0].parent
        raise ValueError(f"{where}: the training or eval data differ between ranks: rank(s) {names} of "
                         f"{len(digests)} see other shards or sample lengths than rank 0 (a missing or partial "
                         "copy on node-local storage?); every rank must read the same data")
