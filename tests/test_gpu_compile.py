"""bench/gpu_compile.py on the fake H100 (bench/fake_h100.py): inductor's GPU path compiles the driver's flat LAMB
update into a few kernels, and the graph the H100 and H200 failed on (the gradients' cast inside it, inductor's own
options) fails here as it failed there (torch 2.11: `reorder_loops_by_dep_pair`), which shows the fake reaches the GPU
scheduler. Needs torch's CUDA build and Triton (`bash scripts/test_torch.sh 2.11.0`); skips in the CPU install."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from script_modules import ROOT, load_script

fake_h100 = load_script("bench/fake_h100.py")
WHY = fake_h100.usable()


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_the_flat_update_compiles_for_the_gpu_and_the_graph_the_gpus_failed_on_fails_here(tmp_path):
    out = tmp_path / "gpu_compile.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--targets", "flat-update",
                           "flat-update-cast-in-graph", "layers-forward", "--bert-config", "tiny", "--tokens", "512",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["target"]: r for r in json.loads(out.read_text())["rows"]}
    # two graphs (the first step's, which makes the state, and every later step's), no break, each a few passes over
    # whole buffers: the gradients are cast into the flat buffer before the graph (MasterWeights.step), where inside
    # it each tensor took a temporary and a copy back (51 kernels a graph for BERT tiny, 317 for large)
    flat = rows["flat-update"]
    assert flat["compiled"] and (flat["graphs"], flat["graph_breaks"]) == (2, 0) and 10 <= flat["triton_kernels"] <= 40
    assert rows["layers-forward"]["compiled"] and rows["layers-forward"]["triton_kernels"] > 5
    in_graph = rows["flat-update-cast-in-graph"]
    if torch.__version__.startswith("2.11."):  # the release the device machines run, which failed on them
        assert not in_graph["compiled"] and "reorder_loops_by_dep_pair" in in_graph["where"], in_graph


def test_the_fake_gpu_is_refused_in_one_line_by_a_torch_without_cuda(tmp_path):
    if WHY is None:
        pytest.skip("this torch can compile for the fake GPU")
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--json", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout.startswith(f"gpu_compile: {WHY};") and "test_torch.sh 2.11.0" in \
        done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "x.json").exists()
