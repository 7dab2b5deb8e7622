"""Low-precision gradient communication: buckets travel as bf16 or fp16, everything else stays fp32
(TPU [004] §3.3 sums BERT's gradients in bfloat16 to cut the reduction's cost).

`compressed(inner, dtype)` is a Reduce that casts the buffer to `dtype`, runs `inner` (flat or hierarchical)
on the half-size copy and writes the sum back into the original buffer. Clipping hooks run before it,
so norms and clip factors are computed on the full-precision gradient; only the averaging is rounded.
The buffer arrives divided by the world size (by the loss, or by `divided` first: bert.dist.reduce), so an
fp16 sum stays in range whenever every rank's term does (fp16 is meant for PRECISION=fp16, whose
GradScaler skips a step with an inf; bf16 has fp32's range).

Error bound (round-to-nearest, unit roundoff u = 2^-8 for bf16, 2^-11 for fp16): each rank's term is
rounded by the cast and by the division (2u), and the N-term sum adds at most (N-1)u relative to the sum
of |terms| whatever the summation order (flat ring or hierarchical), so elementwise
    |mean_compressed - mean| <= (N+1) u * mean_r |g_r| + (N+1) eta      (to first order in u)
with eta the spacing of the dtype's subnormals (2^-24 for fp16), for values that underflow.

Why not torch's `ddp_comm_hooks.default_hooks`: `bf16_compress_hook`/`fp16_compress_hook` are whole comm
hooks hard-wired to the flat allreduce, and `bf16_compress_wrapper`/`fp16_compress_wrapper` wrap a hook
through `GradBucket.set_buffer`. Here the clipping hooks hand a Reduce a plain tensor (clip-before sends one
concatenation of all buckets, which is no GradBucket), so the same three steps are done on the tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.futures import Future

if TYPE_CHECKING:
    from bert.dist.reduce import Reduce

# GRAD_COMM_DTYPE -> the dtype buckets travel in; fp32 means no cast (the gradients' own dtype).
COMM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compressed(inner: Reduce, dtype: torch.dtype) -> Reduce:
    """`inner` run on a `dtype` copy of the buffer; the result lands in the original buffer."""

    def reduce(flat: Tensor) -> Future[Tensor]:
        if flat.dtype == dtype:
            return inner(flat)
        low = flat.to(dtype)
        return inner(low).then(lambda fut: flat.copy_(fut.value()))

    return reduce
