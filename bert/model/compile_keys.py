"""What torch's compile caches key a graph on, where our graphs need more than torch's defaults.

A driver with COMPILE_CACHE (bert.train.compile_cache), or one on a machine whose local caches saw the graphs, takes
AOT autograd's and inductor's graphs from the caches instead of tracing and compiling them. Two kinds of node in our
graphs need a setting for that to be both possible and safe:

- **Our custom ops** (`bert::flash_varlen`, `bert::cudnn_varlen`): both caches key a graph holding one on the op's
  name, but the graph they keep has the op's fake implementation and its backward traced in. An edit of either would
  be served from a cache made before it. `key_on_source` puts a hash of the op's module into both keys, through
  inductor's own setting for it (`unsafe_marked_cacheable_functions`, a name to a key string, part of inductor's
  config and so of both keys): an edit misses, and the run compiles as it would have.
- **Autograd Functions** (delayed float8's GEMMs, `bert.model.fp8_delayed`): AOT autograd does not cache a graph
  holding one unless `autograd_cache_allow_custom_autograd_functions` is on (off by default in torch 2.11 and 2.13,
  PyTorch's plan being to turn it on once it has tested it; PR 149751). Dynamo traces the Function's forward and
  backward into the graph it hands AOT autograd (the `autograd_function_apply` higher-order op, with both as
  subgraphs), so both are in the key and an edit misses (tests/test_compile_keys.py). Without it every float8 row
  traced its whole model again when loading its graphs from a file: `fp8-delayed` took 117-138 s to load on the
  2-core VM (bench/gpu_cache.py, 2026-11-27). `cache_autograd_functions` turns it on; `compile_model` calls it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config


def source_hash(file: str | Path) -> str:
    """16 hex digits of sha256 over the file's bytes."""
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]


def key_on_source(op: str, file: str | Path) -> None:
    """Key every cached graph holding custom op `op` ("namespace::name") on a hash of `file`, the module that defines
    its fake and its backward."""
    marked = dict(torch._inductor.config.unsafe_marked_cacheable_functions)  # replaced, not mutated: torch's
    marked["torch.ops." + op.replace("::", ".")] = source_hash(file)      # config module owns the default
    torch._inductor.config.unsafe_marked_cacheable_functions = marked


def cache_autograd_functions() -> None:
    """Let AOT autograd cache graphs holding an autograd Function (module doc)."""
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
