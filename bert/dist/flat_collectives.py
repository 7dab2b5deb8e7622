"""The flat-tensor collectives under the name each torch release has.

torch 2.13 renamed `reduce_scatter_tensor` / `all_gather_into_tensor` to `reduce_scatter_single` /
`all_gather_single` and deprecated the old names (a FutureWarning per call); torch 2.11, the build on the H100
machines and in current NGC images, has only the old ones. Same signatures: (output, input, op/group, async_op).
"""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
