"""bert.optim.bias_correction: `bert::lamb_bias_corrections` gives the host's float64 corrections rounded to fp32, bit
for bit (the reference: Python's float64 pow and a correctly rounded sqrt, then numpy's rounding to float32), for one
count and for one per group; its fake and schema pass torch's op check; and a compiled LAMB step reads the op's
output instead of computing the corrections itself (on the fake H100, no kernel of the update computes a pow:
tests/test_gpu_compile.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bert.optim.bias_correction import lamb_bias_corrections
from bert.optim.lamb import Lamb, _bias_corrections

BETAS = (0.60466, 0.85437)  # the MLPerf BERT reference's LAMB betas


def host(b1: float, b2: float, t: int) -> tuple[float, float]:
    return float(np.float32(1.0 - b1**t)), float(np.float32(math.sqrt(1.0 - b2**t)))


@pytest.mark.parametrize("betas", [BETAS, (0.9, 0.999)])
def test_the_op_is_the_hosts_float64_corrections_rounded_to_fp32(betas):
    counts = [1, 2, 3, 7, 100, 1000, 7038, 2**20]
    for t in counts:
        c1, sqrt_c2 = lamb_bias_corrections(torch.tensor(float(t)), *betas).tolist()
        assert (c1, sqrt_c2) == host(*betas, t), t
        assert [float(x) for x in _bias_corrections(*betas, torch.tensor(float(t)))] == [c1, sqrt_c2]
    per_group = lamb_bias_corrections(torch.tensor([float(t) for t in counts]), *betas)
    assert per_group.shape == (len(counts), 2) and per_group.dtype == torch.float32
    assert [tuple(row) for row in per_group.tolist()] == [host(*betas, t) for t in counts]


def test_the_op_passes_torchs_op_check():
    for t in (torch.tensor(3.0), torch.tensor([1.0, 5.0])):
        torch.library.opcheck(lamb_bias_corrections, (t, *BETAS))


def test_a_compiled_step_takes_the_corrections_from_the_op_and_equals_eager():
    """The op stays a node of the compiled update's graph (its float64 arithmetic is not in the graph inductor
    fuses), and the weights after three steps of that graph, run eagerly, are eager's bit for bit (what inductor
    then makes of the graph on a GPU: tests/test_gpu_compile.py)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def run(compiled: bool) -> tuple[list[torch.Tensor], list]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
        opt = Lamb(params, lr=torch.tensor(0.01), betas=BETAS, weight_decay=0.01, capturable=True)
        nodes: list = []

        def count(gm, example_inputs):
            nodes.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        step = torch.compile(opt.step, backend=aot_autograd(fw_compiler=count)) if compiled else opt.step
        for k in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
            step()
        return [p.detach().clone() for p in params], nodes

    torch._dynamo.reset()
    eager, _ = run(False)
    compiled, nodes = run(True)
    torch._dynamo.reset()
    assert torch.ops.bert.lamb_bias_corrections.default in nodes
    assert torch.ops.aten.pow.Scalar not in nodes and torch.ops.aten.pow.Tensor_Scalar not in nodes
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_op_gives_the_hosts_corrections_within_an_fp32_ulp_and_a_cuda_graph_replays_it():
    """On the GPU the float64 pow is CUDA's (within 2 ulp of float64), so after rounding to fp32 the corrections
    are the host's or a neighbour. Captured in a CUDA graph (it syncs nothing with the host), a replay after the
    count moves gives the new count's corrections."""
    counts = torch.tensor([1.0, 2.0, 7.0, 100.0, 7038.0], device="cuda")
    got = lamb_bias_corrections(counts, *BETAS).cpu()
    want = torch.tensor([host(*BETAS, int(t)) for t in counts.tolist()])
    assert got.dtype == torch.float32 and bool((got.view(torch.int32) - want.view(torch.int32)).abs().max() <= 1)
    t = torch.tensor(3.0, device="cuda")
    lamb_bias_corrections(t, *BETAS)  # kernels loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lamb_bias_corrections(t, *BETAS)
    t.fill_(11.0)
    graph.replay()
    assert torch.equal(captured, lamb_bias_corrections(t, *BETAS))
