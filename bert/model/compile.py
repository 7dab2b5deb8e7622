"""`torch.compile` of the model, chosen by `COMPILE` (off | default | max-autotune | max-autotune-no-cudagraphs |
reduce-overhead | debug).

The model is compiled in place (`nn.Module.compile`), so its type, its parameter names (checkpoints,
weight decay groups) and DDP wrapping are unchanged. `dynamic=True` keeps one compiled graph over
every token count T and masked count M (a training batch has a fixed number of sequences but not a
fixed T): on an H100 with bf16 it gave 769 samples/s against 585 eager (issue 9). `reduce-overhead`
adds inductor's CUDA graphs: forward and backward are captured and replayed, one recording per distinct
shape (recording is cheap, compiling is not, so the graph stays dynamic). `max-autotune-no-cudagraphs` times
Triton GEMM templates against cuBLAS for every GEMM shape and keeps the faster, so a template that wins can take
a bias and GELU into its epilogue (one pass less over the FFN's activations); its compile is much longer, and on
one H200 the compiled step was 96 % GPU-busy already, so it is kernels, not launches, that it could save (not
measured yet: `driver-compiled-autotune` in bench/cuda_session.sh). With `STATIC_TOKENS`
(`bert.static_shapes`) a run sees a few shapes, so a few recordings serve every step. `debug` captures
the same graphs (dynamo, AOT autograd) but runs them eagerly (torch's `aot_eager` backend): no code
generation, so it is quick, and it is how the CPU tests check that capture leaves the results unchanged.

`COMPILE_SCOPE` says what one compiled graph holds:

    model   the whole model (forward, and AOT autograd's backward): the most fusion. Under DDP, dynamo's
            DDPOptimizer cuts the graph at DDP's bucket boundaries, so each bucket's all-reduce still starts
            while the rest of the backward runs; under `GRAD_BUCKETS=balanced` (`bert.dist.fusion`, which
            is not DDP) nothing cuts it, every gradient appears when the whole backward has run, and no
            communication overlaps it: the config refuses that pairing.
    layers  the embeddings, each encoder layer and the heads with their losses, compiled apart, as torchtitan
            compiles each transformer block: the encoder layers share one graph (dynamo does not
            specialise on the module), so the tracing is that of one layer (two: the last, which keeps only the
            rows the losses read after its attention, `bert.model.last_layer`, has its own), and each layer's
            gradients are handed over as soon as its backward has run, under either wrapper (tests/test_compile.py).

Nothing falls back silently: a mode that cannot run here (no C++ compiler for inductor's CPU code, no
Triton for its GPU code, CUDA graphs without CUDA) is a `ValueError` naming the setting.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from bert.model.compile_keys import configure_caches
from bert.model.pretraining import BertForPreTraining

COMPILE_MODES: dict[str, tuple[str, str | None] | None] = {  # COMPILE -> (backend, mode); None: not compiled
    "off": None,
    "default": ("inductor", "default"),
    "max-autotune": ("inductor", "max-autotune"),
    "max-autotune-no-cudagraphs": ("inductor", "max-autotune-no-cudagraphs"),
    "reduce-overhead": ("inductor", "reduce-overhead"),
    "debug": ("aot_eager", None),
}
INDUCTOR_MODES = tuple(name for name, how in COMPILE_MODES.items() if how and how[0] == "inductor")
# The inductor modes that record CUDA graphs (one per distinct shape), each with its mode without them
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
CUDA_GRAPH_MODES = tuple(WITHOUT_CUDA_GRAPHS)


def _cxx_compiler() -> str | None:
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


def check_compile(name: str, device: torch.device) -> None:
    """Raise a one-line ValueError naming COMPILE when `name` cannot run on `device`."""
    if name not in COMPILE_MODES:
        raise ValueError(f"COMPILE={name!r} is not one of {', '.join(COMPILE_MODES)}")
    if COMPILE_MODES[name] is None or COMPILE_MODES[name][0] != "inductor":
        return
    if device.type == "cpu":
        if name == "reduce-overhead":
            raise ValueError("COMPILE=reduce-overhead captures CUDA graphs and needs a CUDA device; "
                             "use COMPILE=default on the CPU")
        if _cxx_compiler() is None:
            raise ValueError(f"COMPILE={name} on the CPU needs a C++ compiler for inductor (no g++, c++ or "
                             "clang++ on PATH, or set CXX); use COMPILE=off")
    elif device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"COMPILE={name} on CUDA needs Triton (not installed); use COMPILE=off")


COMPILE_SCOPES = ("model", "layers")


def configure_inductor(combo_kernels: bool) -> None:
    """COMBO_KERNELS: inductor launches independent kernels of a graph as one combo kernel, each a program range of
    it. Delayed float8 leaves many that move a few bytes (BERT-large's per-layer step on the fake H100: 757 of 873
    launches under 1 MB: each linear's scales, its amax records, the dropout seeds, the weights' amax second
    passes), and each costs a launch's few microseconds however little it does; combined 344 remain
    (bench/gpu_compile.py). A process-wide setting of inductor's (torch.compile takes a mode or options, not
    both), so it holds for every graph compiled after it, the compiled update's too, and it is in the compile
    cache's key."""
    torch._inductor.config.combo_kernels = combo_kernels


def compile_model(model: BertForPreTraining, name: str, device: torch.device, scope: str = "model",
                  combo_kernels: bool = False) -> BertForPreTraining:
    """Compile `model` in place (after `check_compile`), as one graph or per layer (`scope`); returns the same
    module. It compiles on its first call: `bert.train.warmup` makes that call before run_start. `combo_kernels`:
    COMBO_KERNELS (`configure_inductor`)."""
    check_compile(name, device)
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"COMPILE_SCOPE={scope!r} is not one of {', '.join(COMPILE_SCOPES)}")
    if COMPILE_MODES[name] is None:
        return model
    backend, mode = COMPILE_MODES[name]
    configure_caches()  # keyed on our custom ops' code, float8's Function cached (bert.model.compile_keys)
    configure_inductor(combo_kernels)
    options = {"backend": backend, "mode": mode, "dynamic": True}
    if scope == "model":
        model.compile(**options)
        return model
    model.bert.embeddings.compile(**options)
    for layer in model.bert.encoder.layer:
        layer.compile(**options)
    # the heads and losses are a method (they also use the pooler and the word embeddings): compiled on the instance
    model.heads = torch.compile(model.heads, **options)
    return model
