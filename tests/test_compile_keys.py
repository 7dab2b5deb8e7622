"""bert.model.compile_keys: a second compile of the same code takes AOT autograd's and inductor's graphs from their
caches, and an edit of code traced into those graphs misses them, for the two kinds of node torch does not key (or
cache) as our graphs need: our custom ops and delayed float8's autograd Function. The reference is torch's own
counters over compiles in one process with dynamo reset between them (as a second process starts, with the caches of
the first)."""

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from test_cudnn_varlen import LENGTHS, fused_qkv
from test_flash_varlen import compiles, stand_in
from torch import nn

from bert.batch import SeqLayout
from bert.model import (
    compile_keys,
    cuda_varlen,
    cudnn_varlen,
    dropout_add_norm,
    fp8_delayed,
    fp8_transpose,
    triton_attention,
)
from bert.model.compile import compile_model
from bert.model.cuda_varlen import flash_varlen_op
from bert.model.fp8_delayed import DelayedFloat8Linear
from bert.optim import bias_correction


@pytest.fixture(autouse=True)
def torchs_defaults():
    """Each test starts from torch's defaults for both settings, and leaves them as they were (they are the process's:
    a test that compiles the model, in this worker before, sets them)."""
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions={}), \
            torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=False):
        yield


def marked() -> dict[str, str]:
    return dict(torch._inductor.config.unsafe_marked_cacheable_functions)


def test_each_custom_op_is_keyed_on_its_modules_source():
    compile_keys.configure_caches()
    assert marked()["torch.ops.bert.flash_varlen"] == compile_keys.source_hash(cuda_varlen.__file__)
    assert marked()["torch.ops.bert.cudnn_varlen"] == compile_keys.source_hash(cudnn_varlen.__file__)
    assert marked()["torch.ops.bert.fp8_transpose"] == compile_keys.source_hash(fp8_transpose.__file__)
    assert marked()["torch.ops.bert.lamb_bias_corrections"] == compile_keys.source_hash(bias_correction.__file__)
    assert marked()["torch.ops.bert.dropout_add_layer_norm"] == compile_keys.source_hash(dropout_add_norm.__file__)
    assert marked()["torch.ops.bert.triton_attention"] == compile_keys.source_hash(triton_attention.__file__)
    # and every op of ours the model can call, but a backward (keyed with its forward's module): a new op unkeyed
    # would be served from a cache made before an edit of it
    ours = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("bert::")}
    assert {f"torch.ops.bert.{op}" for op in ours if not op.endswith("_backward")} <= set(marked())
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions
    assert compile_keys.settings() == {"unsafe_marked_cacheable_functions": marked(),
                                       "autograd_cache_allow_custom_autograd_functions": True}
    assert len(compile_keys.SOURCES["torch.ops.bert.flash_varlen"]) == 16


def test_the_fingerprint_names_the_settings_as_torch_has_them(monkeypatch):
    here = compile_keys.fingerprint()  # after configure_caches, read back from torch
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions and len(here) == 16
    monkeypatch.setitem(compile_keys.SOURCES, "torch.ops.bert.flash_varlen", "0" * 16)
    edited = compile_keys.fingerprint()
    assert edited != here
    # torch's own value, where it is not what configure_caches set (an environment variable of torch's forces it)
    monkeypatch.setattr(compile_keys, "configure_caches", lambda: None)
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = False
    assert compile_keys.fingerprint() != edited


def test_an_edit_of_a_custom_ops_module_misses_both_caches(monkeypatch, tmp_path):
    """The op's backward is traced into the cached graph, which torch keys on the op's name: without its module's
    hash in the key, the third compile (after an 'edit') would be served the graphs of the first."""
    stand_in(monkeypatch)
    edited = tmp_path / "cuda_varlen.py"
    edited.write_bytes(open(cuda_varlen.__file__, "rb").read() + b"# an edit\n")
    seq = SeqLayout.from_lengths(LENGTHS)

    def step(qkv):
        return (flash_varlen_op(*qkv.unbind(1), seq.cu_seqlens, seq.max_seqlen, 0.1)[0] * 2).sum()

    def edit():
        monkeypatch.setitem(compile_keys.SOURCES, "torch.ops.bert.flash_varlen", compile_keys.source_hash(edited))
        compile_keys.configure_caches()

    compile_keys.configure_caches()
    first, second, third = compiles(step, [fused_qkv(LENGTHS)[0]], [None, None, edit])
    assert first["aot"] == {"saved": 1} and first["inductor"] == {"miss": 2}
    assert second["aot"] == {"hit": 1} and second["inductor"] == {"hit": 2}
    assert third["aot"] == {"saved": 1} and third["inductor"] == {"miss": 2}


def test_a_float8_layers_graph_is_cached_and_an_edit_of_its_backward_misses(monkeypatch):
    """Delayed float8's GEMMs are an autograd Function: by default AOT autograd bypasses its cache for the graph
    holding it. With the driver's setting it caches it, and the Function's backward is in the key: an edit of it
    misses, and the gradients are the edited backward's, not the cached one's."""
    torch.manual_seed(0)
    layer = DelayedFloat8Linear.from_linear(nn.Linear(64, 128))
    x = torch.randn(32, 64)
    original = fp8_delayed._Float8Matmul.backward

    def doubled_dx(ctx, grad):
        dx, *rest = original(ctx, grad)
        return dx * 2, *rest

    def step(x):
        return layer(x).sum()

    default, first, second, edited = compiles(step, [x], [  # the first with torch's default (the fixture)
        None, compile_keys.configure_caches, None,
        lambda: monkeypatch.setattr(fp8_delayed._Float8Matmul, "backward", staticmethod(doubled_dx))],
        before=lambda: layer._start_amaxes(x.device))  # each compile from the same scales: a run's amaxes move
    assert default["aot"].get("bypass") and not default["aot"].get("hit")
    assert first["aot"] == {"saved": 1} and not first["aot"].get("bypass")
    assert second["aot"] == {"hit": 1}
    assert edited["aot"] == {"saved": 1}
    assert torch.equal(edited["grads"][0], 2 * second["grads"][0]) and torch.equal(second["grads"][0],
                                                                                   first["grads"][0])


def test_compiling_the_model_configures_the_caches():
    from test_fp8 import tiny_model

    compile_model(tiny_model(), "off", torch.device("cpu"))
    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions and not marked()
    compile_model(tiny_model(), "debug", torch.device("cpu"))
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions
    assert marked() == compile_keys.settings()["unsafe_marked_cacheable_functions"]


def test_compiling_the_optimizers_step_configures_the_caches():
    """The update's graphs are keyed as the model's are, whichever compiles first (a bench compiles the update
    alone)."""
    from bert.optim.compiled import compile_step

    compile_step(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), "debug")
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions
    assert marked() == compile_keys.settings()["unsafe_marked_cacheable_functions"]


FINGERPRINT = """
import sys, torch
from bert.model import compile_keys
print(compile_keys.fingerprint())
import bert.train.build, bert.train.warmup
print(compile_keys.fingerprint())
print(" ".join(sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("bert::"))))
"""


def test_a_process_that_imported_no_model_keys_every_custom_op_as_the_driver_does():
    """bench/gpu_cache.py --key (the device session's setup check) compares a fresh process's fingerprint with the
    one the caches were made under, in a driver that had imported every op's module: the two must agree (without
    the update's op, every carried file would have been called a miss). One process, bare first: its fingerprint
    before and after it imports the driver's modules (what a bare and a driver process would print, for one torch
    import less). Every op registered under `bert::` is keyed (a backward op with its forward, from the same
    module)."""
    import os
    import subprocess
    import sys

    from script_modules import ROOT

    done = subprocess.run([sys.executable, "-c", FINGERPRINT], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    bare, driver, ops = done.stdout.split("\n")[:3]
    assert bare == driver
    ops = {name.removeprefix("bert::").removesuffix("_backward") for name in ops.split()}
    assert {f"torch.ops.bert.{op}" for op in ops} == set(compile_keys.SOURCES)
