"""LAMB's bias corrections from the device's update count, computed by an op the compiler cannot inline
(`bert::lamb_bias_corrections`).

Why: with the count on the device (`Lamb(capturable=True)`, as COMPILE_OPTIMIZER=1 and OPTIMIZER_LAYOUT=flat run
it), the corrections 1 - b1^t and sqrt(1 - b2^t) are float64 arithmetic on a count per param group. Compiled, inductor
inlined that arithmetic into every kernel that reads the corrections. In the H200's generated code (the `compiled-opt`
compile cache, 2026-11-27) the per-tensor update's kernels broadcast the count over their block before computing,
so every element of BERT-large's 336 M parameters computed two float64 pows and a float64 sqrt. Compiled for sm_90
(`bench/sass_count.py`), such a pow is a subroutine of 162 instructions, 79 of them float64, called once per
element: about 55 G float64 instructions a step, which an H100's float64 pipes (33.5 TFLOP/s, an FMA counted as
two) issue in about 3 ms (a static count, and the other 83 instructions of each pow take issue slots too), in an
update that moves ~13 GB (under 3 ms at an H200's bandwidth) and took 7.6 ms there. The flat update's pass
computed them once per row and thread.

An opaque custom op computes both, once per count, in a few tiny kernels of its own. The update's kernels then load
two fp32 scalars. The values are the same float64 arithmetic as before, rounded to fp32: on the CPU the host's
(`bert.optim.lamb._bias_corrections`) bit for bit, on CUDA within an fp32 ulp of them (its float64 pow is within
2 ulp). The op launches no host sync; the CUDA test captures it in a CUDA graph (tests/test_bias_correction.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.model.compile_keys import key_on_source


@torch.library.custom_op("bert::lamb_bias_corrections", mutates_args=())
def lamb_bias_corrections(t: Tensor, b1: float, b2: float) -> Tensor:
    """[1 - b1^t, sqrt(1 - b2^t)] in fp32 along a new last axis, computed in float64 from the counts `t` (a
    0-dim count gives shape [2]; one count per group, [groups] gives [groups, 2])."""
    t = t.double()  # a float64 copy: the count itself stays fp32 (bert.optim.lamb)
    return torch.stack([1.0 - b1**t, (1.0 - b2**t).sqrt()], -1).float()


@lamb_bias_corrections.register_fake
def _(t: Tensor, b1: float, b2: float) -> Tensor:
    return t.new_empty((*t.shape, 2), dtype=torch.float32)


# traced into the update's cached graphs by the op's name: an edit here must miss them (bert.model.compile_keys)
key_on_source("bert::lamb_bias_corrections", __file__)
