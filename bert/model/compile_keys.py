"""What torch's compile caches key a graph on, where our graphs need more than torch's defaults.

A driver with COMPILE_CACHE (bert.train.compile_cache), or one on a machine whose local caches saw the graphs, takes
AOT autograd's and inductor's graphs from the caches instead of tracing and compiling them. Two kinds of node in our
graphs need a setting for that to be both possible and safe:

- **Our custom ops** (`bert::flash_varlen`, `bert::cudnn_varlen`, `bert::fp8_transpose`, those of the other
  `OP_MODULES`): both caches key a graph holding one on the op's name, but the graph they keep has the op's fake
  implementation and its backward traced in (the transpose's kernel is run by name), so an edit of either would be
  served from a cache made before it.
  Each op's module registers a hash of its own source (`key_on_source`), and `configure_caches` puts those hashes
  into inductor's setting for it (`unsafe_marked_cacheable_functions`, a name to a key string). That setting is
  part of inductor's config, which is in every graph's key, AOT autograd's and inductor's: an edit of any such
  module misses every cached graph (the LAMB update's too), and the run compiles as it would have.
- **Autograd Functions** (delayed float8's GEMMs, `bert.model.fp8_delayed`): AOT autograd does not cache a graph
  holding one unless `autograd_cache_allow_custom_autograd_functions` is on (off by default in torch 2.11 and 2.13,
  PyTorch's plan being to turn it on once tested: pytorch/pytorch#149751). Dynamo traces the Function's forward and
  backward into the graph it hands AOT autograd (the `autograd_function_apply` higher-order op, both as subgraphs),
  so both are in the key and an edit misses (tests/test_compile_keys.py); a Function dynamo cannot trace is a graph
  break, run eagerly, never cached. What a Function's body calls by name (a custom op) is keyed on the name alone:
  ours calls aten ops and `bert::fp8_transpose`, keyed on its module's source as above. Without the setting every
  float8 row traced its whole model again when loading its graphs from a file: `fp8-delayed` took 117-138 s to
  load on the 2-core VM (bench/gpu_cache.py, 2026-11-27).

Both are process settings, needed where the caches are written and where they are read (they are in the key).
`compile_model` and the optimizer's `compile_step` apply them before anything compiles. Registering a hash costs nothing
at import: torch's inductor config is imported only by `configure_caches` (it pulls in dynamo, about a second a
process).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

SOURCES: dict[str, str] = {}  # "torch.ops.<namespace>.<op>" -> its module's hash, from key_on_source
# Every module defining one of our custom ops (each registers its hash when imported), imported by `settings`: a
# process keys its graphs on all of them whatever it imported before. bench/gpu_cache.py's setup check imports no
# model or optimizer, and without the update's op its fingerprint differed from the caches' (2026-11-27).
OP_MODULES = ("bert.model.cuda_varlen", "bert.model.cudnn_varlen", "bert.model.fp8_transpose",
              "bert.optim.bias_correction", "bert.model.dropout_add_norm", "bert.model.triton_attention",
              "bert.model.bias_gelu", "bert.model.fp8_bias_gelu", "bert.model.fp8_residual_norm",
              "bert.model.fp8_attention", "bert.model.fp8_feed_forward", "bert.model.fp8_attention_block")


def source_hash(file: str | Path) -> str:
    """16 hex digits of sha256 over the file's bytes."""
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]


def key_on_source(op: str, file: str | Path) -> None:
    """Register custom op `op` ("namespace::name") for `configure_caches` to key the caches on a hash of `file`, the
    module that defines its fake and its backward."""
    SOURCES["torch.ops." + op.replace("::", ".")] = source_hash(file)


def settings() -> dict:
    """What `configure_caches` sets, by torch's names (the marked functions merged into any already there)."""
    for module in OP_MODULES:
        importlib.import_module(module)
    return {"unsafe_marked_cacheable_functions": dict(SOURCES), "autograd_cache_allow_custom_autograd_functions": True}


def _torch_configs() -> dict:
    """Each setting's torch config module, imported on first use (module doc)."""
    import torch._functorch.config
    import torch._inductor.config

    return {"unsafe_marked_cacheable_functions": torch._inductor.config,
            "autograd_cache_allow_custom_autograd_functions": torch._functorch.config}


def configure_caches() -> None:
    """Apply `settings()` to this process's torch (module doc)."""
    for name, config in _torch_configs().items():
        value = settings()[name]
        if isinstance(value, dict):  # replaced, not mutated: torch's config module owns the default
            value = {**getattr(config, name), **value}
        setattr(config, name, value)


def fingerprint() -> str:
    """16 hex digits naming the settings as this process's torch has them after `configure_caches` (an environment
    variable of torch's can force one off): files cached under other settings miss (bench/gpu_cache.py compares)."""
    configure_caches()
    applied = {name: getattr(config, name) for name, config in _torch_configs().items()}
    return hashlib.sha256(json.dumps(applied, sort_keys=True).encode()).hexdigest()[:16]
