"""bench/gpu_cache.py: a device session's compile caches, made on this CPU for a real H100.

The references: torch's own cache counters in a second process that loads the file (inductor took every graph from
it and compiled none), torch's deserializer for what the file holds, and, for whether the fake traces the GPU's
graphs at all, dynamo's graphs of the same model on real tensors. The compile needs torch's CUDA build, Triton and a
C compiler (`bash scripts/test_torch.sh 2.11.0`); the rest runs in the CPU install."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import pytest
import torch
from script_modules import ROOT, load_script

from bert.model import compile_keys

fake_h100 = load_script("bench/fake_h100.py")
gpu_cache = load_script("bench/gpu_cache.py")
WHY = fake_h100.usable() or (None if shutil.which("cc") else "no C compiler")


class KeyTaken(Exception):
    """Raised once inductor has its cache key for the first graph: nothing compiles (a fake CPU tensor cannot run)."""


def first_graph(fake: bool) -> tuple[list[str], str]:
    """Dynamo's graphs of BERT tiny's training forward on the CPU, with the model made under a fake mode (as the fake
    H100 makes it) or real, their inputs' type annotations left out (Parameter or FakeTensor); and the key inductor
    computes for the first one's forward (the model's: what the GPU looks up). The truncated normal, which reads a
    value on the host under torch 2.13's fake mode, is left out: the values do not matter. One layer: every layer
    runs the same code, and tracing time grows with their count (two took 60 % longer)."""
    from torch._inductor import codecache
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bert.model import BertConfig, BertForPreTraining
    from bert.synthetic import random_batch

    graphs, keys = [], []
    real_hash = codecache.compiled_fx_graph_hash

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(re.sub(r" : [\w.]+", "", gm.code))
        return torch._inductor.compile(gm, example_inputs)

    def take_key(*args, **kwargs):
        keys.append(real_hash(*args, **kwargs)[0])
        raise KeyTaken

    torch._dynamo.reset()
    batch = random_batch((9, 17, 30), seed=0, vocab_size=BertConfig.load("tiny").vocab_size)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), \
                mock.patch.object(torch.nn.init, "trunc_normal_", lambda tensor, **kwargs: tensor), \
                mock.patch.object(codecache, "compiled_fx_graph_hash", take_key), pytest.raises(Exception) as e:
            torch.manual_seed(0)
            model = BertForPreTraining(replace(BertConfig.load("tiny"), num_hidden_layers=1), attention="padded")
            torch.compile(model, backend=capture, dynamic=True)(batch)
    finally:
        torch._dynamo.reset()
    assert "KeyTaken" in repr(e.value) or isinstance(e.value.__cause__, KeyTaken), e.value
    return graphs, keys[0]


def test_the_fake_modes_tensors_give_the_graphs_and_cache_key_real_ones_give():
    """A cached graph is keyed on its graph and its inputs: made from the fake mode's tensors, it must be the one the
    GPU traces from real ones, or the GPU misses (a model that looked at its parameters' type, say). Here on the CPU,
    where both can be traced; the fake H100's own patches are checked by the graph breaks bench/gpu_compile.py counts
    (tests/test_gpu_compile.py: a Tensor method the fake inlined broke the graph there, and not on the GPU)."""
    real_graphs, real_key = first_graph(fake=False)
    fake_graphs, fake_key = first_graph(fake=True)
    assert real_graphs and fake_graphs == real_graphs
    assert fake_key == real_key


def test_rows_the_fake_cannot_compile_are_refused_by_name(tmp_path):
    data = tmp_path / "shards"
    subprocess.run([sys.executable, str(ROOT / "data/make_random_shards.py"), "--out", str(data), "--samples", "200",
                    "--shards", "1", "--eval-samples", "100"], check=True, capture_output=True)
    name = fake_h100.GPUS["h100"][0]
    for row, why in [("compiled-autotune", "COMPILE=max-autotune-no-cudagraphs is not compiled here"),
                     ("compiled-sharded", "OPTIMIZER_SHARDING=1 is not compiled here"),
                     ("bf16", "COMPILE=off compiles nothing")]:
        with pytest.raises(ValueError, match=why):
            gpu_cache.driver_environment(row, name, tmp_path / "caches", data, tmp_path / row)
    env = gpu_cache.driver_environment("compiled-flat", name, tmp_path / "caches", data, tmp_path / "flat")
    # where the session's driver on that card will look for it (cuda_session.sh: nvidia-smi's name, made a folder)
    assert env["COMPILE_CACHE"] == str(tmp_path / "caches" / "NVIDIA_H100_80GB_HBM3" / "compiled-flat.bin.gz")
    assert (env["DEVICE"], env["COMPILE"], env["OPTIMIZER_LAYOUT"]) == ("cuda", "default", "flat")
    # CUDA graphs are the trees' on the GPU, from graphs inductor compiles as here (fake_h100.CudaGraphs)
    env = gpu_cache.driver_environment("graphs-opt", name, tmp_path / "caches", data, tmp_path / "graphs")
    assert (env["COMPILE"], env["STATIC_TOKENS"]) == ("reduce-overhead", "512"), env


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build, Triton and a C compiler: {WHY}")
def test_a_rows_cache_made_here_serves_every_graph_to_a_later_process(tmp_path):
    from torch.compiler._cache import CacheArtifactManager

    out, caches = tmp_path / "gpu_cache.json", tmp_path / "caches"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_cache.py"), "--gpus", "h100", "--rows",
                           "compiled-flat", "--flags", "--bert-config tiny --batchsize 8", "--caches", str(caches),
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    first, again = row["compile"], row["from_file"]
    # the model's forward and backward and the update's two graphs compiled once, then all taken from the file
    assert row["served"] and first["graphs_compiled"] >= 4 and not first["graphs_from_cache"]
    # its compile had inductor's two workers ready (the fake's Triton driver from the stand-ins' sitecustomize)
    assert first["compile_workers"] == again["compile_workers"] == 2
    assert again["graphs_from_cache"] == first["graphs_compiled"] and again["graphs_compiled"] == 0
    # and AOT autograd's: no graph holds an autograd Function (flash attention with dropout is a custom op)
    assert first["aot_uncacheable"] == again["aot_uncacheable"] == 0 and again["aot_from_cache"] >= 3
    assert first["key"]["device"] == {"name": "NVIDIA H100 80GB HBM3"} and first["key"]["cuda"] == torch.version.cuda
    held = CacheArtifactManager.deserialize(gzip.decompress((caches / "NVIDIA_H100_80GB_HBM3" /
                                                             "compiled-flat.bin.gz").read_bytes()))
    # the graphs, and no autotuning choice: the fake's timings are all equal, the GPU tunes for itself
    assert len(held["inductor"]) == first["graphs_compiled"] and "autotune" not in held
    # what the session's setup step compares with the machine's own key parts
    made = {"NVIDIA_H100_80GB_HBM3/compiled-flat.bin.gz": first["key"]}
    assert json.loads((caches / gpu_cache.MADE_FOR).read_text()) == made


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build, Triton and a C compiler: {WHY}")
def test_a_cuda_graph_rows_cache_is_made_here_with_every_graph_handed_to_the_trees(tmp_path):
    """COMPILE=reduce-overhead (driver-graphs): the driver's own warm-up (each token bucket twice) compiles under the
    fake, inductor hands every graph to the CUDA graph trees and skips none (fake_h100.CudaGraphs), and a later
    process takes every graph from the file."""
    out, caches = tmp_path / "gpu_cache.json", tmp_path / "caches"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_cache.py"), "--gpus", "h100", "--rows", "graphs",
                           "--flags", "--bert-config tiny --batchsize 8", "--caches", str(caches),
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    first, again = row["compile"], row["from_file"]
    assert row["served"] and again["graphs_compiled"] == 0 and again["graphs_from_cache"] == first["graphs_compiled"]
    for report in (first, again):
        assert report["cudagraph_skips"] == [], report
        # the training step's graphs, forward and backward (the run stops before an evaluation: no eval forward)
        assert report["cudagraphs"]["forward"] == report["cudagraphs"]["backward"] >= 1, report["cudagraphs"]


def test_the_setup_step_says_whether_the_carried_caches_fit_the_machine(tmp_path):
    h100 = {"torch_key": "36e6", "device": {"name": "NVIDIA H100 80GB HBM3"}, "system_hash": "2b00",
            "torchao": "0.18.0", "compile_keys": "c0de", "cxx": "/opt/gcc/bin/g++"}
    folder = tmp_path / gpu_cache.card_folder("NVIDIA H100 80GB HBM3")
    assert folder.name == "NVIDIA_H100_80GB_HBM3"  # cuda_session.sh's name for it (test_rows_the_fake_cannot...)
    folder.mkdir()
    for row in ("a", "b"):
        (folder / f"{row}.bin.gz").write_bytes(b"")
    made = {"NVIDIA_H100_80GB_HBM3/a.bin.gz": h100, "NVIDIA_H100_80GB_HBM3/b.bin.gz": h100,
            "NVIDIA_H100_80GB_HBM3/gone.bin.gz": {**h100, "torch_key": "old"}}  # its file no longer there: left out
    (tmp_path / gpu_cache.MADE_FOR).write_text(json.dumps(made))
    assert gpu_cache.compare_with_caches(tmp_path, h100).endswith(
        "2 files made with this torch, Triton, CUDA, torchao, card and custom ops: they should serve, unless the "
        "model's code changed since")
    line = gpu_cache.compare_with_caches(tmp_path, {**h100, "torch_key": "9999"})
    assert "2 of 2 files made with other key parts" in line and "torch_key 36e6 there, 9999 here" in line
    assert "torchao 0.18.0 there, None here" in gpu_cache.compare_with_caches(tmp_path, {**h100, "torchao": None})
    made["NVIDIA_H100_80GB_HBM3/b.bin.gz"] = {**h100, "system_hash": "0"}
    (tmp_path / gpu_cache.MADE_FOR).write_text(json.dumps(made))
    assert "1 of 2 files made with other key parts (NVIDIA_H100_80GB_HBM3/b.bin.gz: system_hash 0 there" in \
        gpu_cache.compare_with_caches(tmp_path, h100)
    # made before an edit of a custom op's module (or before bert.model.compile_keys): every graph misses
    line = gpu_cache.compare_with_caches(tmp_path, {**h100, "compile_keys": "e417"})
    assert "2 of 2 files made with other key parts" in line and "compile_keys c0de there, e417 here" in line
    assert gpu_cache.key_parts()["compile_keys"] == compile_keys.fingerprint()
    # made with another C++ compiler's name in CXX (inductor keys every graph on it): every graph misses
    line = gpu_cache.compare_with_caches(tmp_path, {**h100, "cxx": "g++"})
    assert "2 of 2 files made with other key parts" in line and "cxx /opt/gcc/bin/g++ there, g++ here" in line
    h200 = {**h100, "device": {"name": "NVIDIA H200"}}
    assert "none made for NVIDIA H200" in gpu_cache.compare_with_caches(tmp_path, h200)
    assert "no CUDA device" in gpu_cache.compare_with_caches(tmp_path / "none", {"device": None})
