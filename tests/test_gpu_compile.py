"""bench/gpu_compile.py on the fake H100 (bench/fake_h100.py): inductor's GPU path compiles the driver's flat LAMB
update into a few kernels, and the graph the H100 and H200 failed on (the gradients' cast inside it, inductor's own
options) fails here as it failed there (torch 2.11: `reorder_loops_by_dep_pair`), which shows the fake reaches the GPU
scheduler; a training step's backward compiles too, and what the graphs launch is counted. Needs torch's CUDA build,
Triton and a C compiler (`bash scripts/test_torch.sh 2.11.0`); skips in the CPU install."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_modules import ROOT, load_script

fake_h100 = load_script("bench/fake_h100.py")
WHY = fake_h100.usable()


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_the_flat_update_compiles_for_the_gpu_and_the_graph_the_gpus_failed_on_fails_here(tmp_path):
    out = tmp_path / "gpu_compile.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--targets", "flat-update",
                           "flat-update-cast-in-graph", "layers-forward", "model-forward", "tensors-update",
                           "--bert-config", "tiny",
                           "--tokens", "512",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["target"]: r for r in json.loads(out.read_text())["rows"]}
    # one step (the second) over every group's rows at once, with the clip's factor folded in: the moments' pass and
    # the weights' pass (which writes the model's bf16 copy too), and a few tiny kernels for the norms; per group,
    # each slice's in-place update became a new buffer and a copy back (13 launches, 2.2x the bytes)
    assert rows["flat-update"]["triton_launches"] <= 8, rows["flat-update"]
    # two graphs (the first step's, which makes the state, and every later step's), no break, each a few passes over
    # whole buffers: the gradients are cast into the flat buffer before the graph (MasterWeights.step), where inside
    # it each tensor took a temporary and a copy back (51 kernels a graph for BERT tiny, 317 for large)
    flat = rows["flat-update"]
    assert flat["compiled"] and (flat["graphs"], flat["graph_breaks"]) == (2, 0) and 10 <= flat["triton_kernels"] <= 40
    assert rows["layers-forward"]["compiled"] and rows["layers-forward"]["triton_kernels"] > 5
    # LAMB's bias corrections come from their op: no kernel of either update computes a pow (with them inlined, the
    # flat update's pass computed two float64 pows a row, the per-tensor update's kernels two an element)
    assert rows["tensors-update"]["compiled"] and rows["tensors-update"]["triton_launches"] > 10
    assert rows["flat-update"]["pow_launches"] == rows["tensors-update"]["pow_launches"] == 0
    # the model's graph breaks where the GPU's does, at the attention plan (eager by design) and nowhere else: a Tensor
    # method written in Python, inlined on the fake mode's tensors (`Tensor.unflatten`), broke it 5 more times
    assert (rows["model-forward"]["graphs"], rows["model-forward"]["graph_breaks"]) == (2, 2), rows["model-forward"]
    in_graph = rows["flat-update-cast-in-graph"]
    if torch.__version__.startswith("2.11."):  # the release the device machines run, which failed on them
        assert not in_graph["compiled"] and "reorder_loops_by_dep_pair" in in_graph["where"], in_graph


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_a_training_steps_backward_compiles_and_delayed_fp8_reads_each_tensor_once_for_its_amax(tmp_path):
    """The forward and backward of a step, per layer, in bf16, with delayed float8 (and BIAS_GELU=fused under it)
    and with the fused residual LayerNorm: every GEMM of the backward
    is launched (float8: the forward's, dgrad's and wgrad's of each encoder linear), and the amaxes do not cost
    passes of their own (bert.model.fp8_delayed.record_amax: by rows, beside the casts), nor the biases (added in
    the scaled GEMMs' epilogue)."""
    out, wide = tmp_path / "gpu_compile.json", tmp_path / "wide.json"
    # BERT-large's layers, two of them, and a small vocabulary: the layers' tensors, not the MLM head's, make the bytes
    layers = 2
    wide.write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 16,
                                "intermediate_size": 4096, "vocab_size": 1024}))
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--targets", "layers-step",
                           "fp8-delayed-layers-step", "fused-norm-layers-step", "fused-bias-gelu-layers-step",
                           "triton-attention-layers-step", "fp8-delayed-biasgelu-layers-step",
                           "fp8-delayed-norm-layers-step", "--bert-config",
                           str(wide),
                           "--tokens", "4096", "--json",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["target"]: r for r in json.loads(out.read_text())["rows"]}
    bf16, fp8 = rows["layers-step"], rows["fp8-delayed-layers-step"]
    assert bf16["compiled"] and bf16["graph_breaks"] == 0, bf16  # the fake's own QKV-split break is gone
    assert fp8["library_calls"]["_scaled_mm"] == 3 * 4 * layers, fp8
    assert sum(bf16["library_calls"].values()) >= 3 * 4 * layers, bf16
    # torch 2.11: 1.44x bf16's bytes (the casts, their transposed copies); 1.57x with the bias added after the GEMM,
    # 1.81x with that and each amax a reduction of the whole tensor, a pass of its own
    assert fp8["triton_gb"] < 1.5 * bf16["triton_gb"], (fp8["triton_gb"], bf16["triton_gb"])
    # no row kernel stores a tensor transposed (bert.model.fp8_transpose: fused into the casts' row kernels, as
    # t().contiguous(), the transposed copies were most of the H200's float8 step; here 12 launches that way)
    assert fp8["strided_store_launches"] == bf16["strided_store_launches"] == 0, fp8["strided_store_kernels"]
    # each float8 copy stored once (bert.model.fp8_transpose's layout tag, and the backward's transpose before its
    # dgrad GEMM; 8.5 GB of BERT-large's step before, 17 kernels of 86 storing twice)
    assert fp8["duplicate_store_launches"] == bf16["duplicate_store_launches"] == 0, fp8["duplicate_store_kernels"]
    # RESIDUAL_NORM=fused (bert.model.dropout_add_norm): each sublayer's close is our op, each way, in the graphs the
    # GPU compiles (no break); inductor's own kernels then move fewer bytes than the ops add (BERT-large, 24,405
    # tokens: 70.7 GB + 14.5 of flash attention against 41.1 + 33.6, results/bench/gpu_compile_fused_norm.json)
    fused = rows["fused-norm-layers-step"]
    assert fused["compiled"] and fused["graph_breaks"] == 0, fused
    assert fused["our_op_calls"]["bert::dropout_add_layer_norm"] == 2 * layers, fused["our_op_calls"]
    assert fused["our_op_calls"]["bert::dropout_add_layer_norm_backward"] == 2 * layers, fused["our_op_calls"]
    assert fused["triton_gb"] + sum(fused["our_op_gb"].values()) < bf16["triton_gb"] + sum(bf16["our_op_gb"].values())

    def total_gb(row):
        return row["triton_gb"] + sum(row["our_op_gb"].values())

    # BIAS_GELU=fused (bert.model.bias_gelu): the FFN's bias gradient summed in our backward's pass, so the step
    # moves fewer bytes in all, by about one read of each layer's (T, 4096) gradient: the first layer's whole, the
    # last's on its loss rows (LAST_LAYER_SUBSET); BERT-large: 4.7 GB of 67.2 + 14.6
    biased = rows["fused-bias-gelu-layers-step"]
    assert biased["compiled"] and biased["graph_breaks"] == 0, biased
    assert biased["our_op_calls"]["bert::bias_gelu"] == biased["our_op_calls"]["bert::bias_gelu_backward"] == layers
    saved, one_layer = total_gb(bf16) - total_gb(biased), 4096 * 4096 * 2 / 1e9
    assert 0.8 * one_layer < saved < 2 * one_layer, (saved, total_gb(bf16), total_gb(biased))
    # and under delayed float8 (bert.model.fp8_bias_gelu): the GELU backward's two passes of inductor (the cast, then
    # the amax and bias sums, computing the gradient again) are one of ours, one (T, 4096) read of two tensors fewer
    # a layer, and the op writes the gradient's transposed copy too, so no bert::fp8_transpose reads it back (2 x 4096
    # tokens: 2.95 (T, 4096) bf16 tensors fewer; BERT-large: 11.6 GB of 105.0)
    fp8_biased = rows["fp8-delayed-biasgelu-layers-step"]
    assert fp8_biased["compiled"] and fp8_biased["graph_breaks"] == 0, fp8_biased
    assert fp8_biased["our_op_calls"]["bert::gelu_backward_fp8"] == layers, fp8_biased["our_op_calls"]
    # (each linear's input and output gradient transposed, but that one; its weight cast with its transpose)
    assert fp8_biased["our_op_calls"]["bert::fp8_transpose"] == 2 * 4 * layers - layers, fp8_biased["our_op_calls"]
    assert fp8_biased["our_op_calls"]["bert::fp8_cast_transpose"] == 4 * layers, fp8_biased["our_op_calls"]
    assert fp8_biased["library_calls"]["_scaled_mm"] == 3 * 4 * layers, fp8_biased
    saved = total_gb(fp8) - total_gb(fp8_biased)
    assert 2.5 * one_layer < saved < 3.5 * one_layer, (saved, total_gb(fp8), total_gb(fp8_biased))
    # and RESIDUAL_NORM=fused under delayed float8 (bert.model.fp8_residual_norm): each close's backward is the
    # float8 op, no graph break, the GEMMs all float8; the dense output gradient's cast is no pass of inductor's, so
    # the step moves no more than with inductor's own LayerNorm (2 x 4096 tokens: 1.32 GB against 1.38; BERT-large,
    # where the residual gradient's add is a pass before our op: 105.6 against 105.0, 107.8 before)
    fp8_norm = rows["fp8-delayed-norm-layers-step"]
    assert fp8_norm["compiled"] and fp8_norm["graph_breaks"] == 0, fp8_norm
    assert fp8_norm["our_op_calls"]["bert::dropout_add_layer_norm_backward_fp8"] == 2 * layers, fp8_norm
    assert "bert::dropout_add_layer_norm_backward" not in fp8_norm["our_op_calls"], fp8_norm["our_op_calls"]
    assert fp8_norm["library_calls"]["_scaled_mm"] == 3 * 4 * layers, fp8_norm
    assert total_gb(fp8_norm) < total_gb(fp8), (total_gb(fp8_norm), total_gb(fp8))
    # ATTENTION=triton's backward writes the QKV's gradient packed (bert.model.attend): no stack of dq, dk, dv,
    # which flash attention's separate gradients still need
    stacks = [[k for k in row["top_kernels_gb"] if "fused_stack" in k and "sum" not in k]
              for row in (bf16, rows["triton-attention-layers-step"])]
    assert stacks[0] and not stacks[1], stacks


# a persistent reduction over rows of 1024 as inductor writes it (an H200's float8 backward, 2026-11-27): the cast
# stored row-major (coalesced) and transposed (`ks0*r0_1`: lanes a row apart), and the row's sum
ROW_KERNEL = """
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_1 = r0_index
        tl.store(out_ptr3 + (x0 + ks0*r0_1), tmp50, xmask)
        tl.store(out_ptr4 + (r0_1 + 1024*x0), tmp59, xmask)
        tl.store(out_ptr6 + (x0 + 4096*r0_1), tmp75, xmask)
        tl.store(out_ptr0 + (x0), tmp10, xmask)
"""


def test_a_row_kernels_transposed_stores_are_told_from_its_coalesced_ones():
    assert fake_h100.strided_row_stores(ROW_KERNEL) == 2
    # the same stores in a pointwise kernel (x the fastest axis, no reduction's rows): not this pattern
    assert fake_h100.strided_row_stores(ROW_KERNEL.replace("[None, :]", "[:, None]")) == 0
    assert fake_h100.strided_row_stores("    r0_index = tl.arange(0, R0_BLOCK)[None, :]\n"
                                        "        tl.store(out_ptr0 + (r0_1 + 1024*x0), tmp1, xmask)\n") == 0
    # a looped reduction (r0 from a base and an offset): a column sum's blocks span many columns, so not counted (the
    # MLM head's log-softmax backward and the pooler's tanh backward store so, in bf16 and float8 alike)
    looped = ROW_KERNEL.replace("r0_index = tl.arange(0, R0_BLOCK)[None, :]",
                                "r0_base = tl.arange(0, R0_BLOCK)[None, :]\n        r0_index = r0_offset + r0_base")
    assert fake_h100.strided_row_stores(looped) == 0


def test_a_kernel_storing_one_value_twice_is_told_from_one_storing_two():
    """Lines of the fake H100's float8 GELU backward before the transpose op's layout tag (2026-12-02): the e5m2
    copy stored to two buffers, one for the scaled GEMM and one for the transpose."""
    twice = """
    tmp34 = tmp33.to(tl.float8e5)
    tl.store(out_ptr1 + (x0), tmp34, None)
    tl.store(out_ptr2 + (x0), tmp34, None)"""
    assert fake_h100.duplicate_stores(twice) == 1
    assert fake_h100.duplicate_stores(twice.replace("out_ptr2 + (x0), tmp34", "out_ptr2 + (x0), tmp35")) == 0
    assert fake_h100.duplicate_stores(twice.replace("out_ptr2 + (x0)", "out_ptr2 + (x0 + 1)")) == 0
    assert fake_h100.duplicate_stores(ROW_KERNEL) == 0
    # a combo kernel (COMBO_KERNELS) whose two parts store alike, each into its own tensor: no value stored twice;
    # within one part, as before
    combo = """
    pid = tl.program_id(0)
    if pid < num_xblocks_0:
        tl.store(out_ptr0 + (x0), tmp3, xmask)
    elif pid < num_xblocks_1:
        tl.store(out_ptr1 + (x0), tmp3, xmask)
    else:
        pass"""
    assert fake_h100.duplicate_stores(combo) == 0
    assert fake_h100.duplicate_stores(combo.replace("        pass", twice.replace("\n    ", "\n        "))) == 1


def test_the_transpose_op_takes_its_input_as_laid_out():
    """bert::fp8_transpose's layout tag: under torch's default (exact strides) inductor realized the op's input
    apart from the scaled GEMM's, two buffers of each float8 copy."""
    import bert.model.fp8_transpose  # noqa: F401 - registers the op

    assert torch.Tag.flexible_layout in torch.ops.bert.fp8_transpose.default.tags


def test_a_kernel_computing_the_bias_corrections_inlined_is_told_from_one_loading_them():
    """Lines of the H200's per-tensor LAMB kernel (the compiled-opt cache, 2026-11-27), and the same loading them."""
    inlined = """
        tmp31 = tmp30.to(tl.float64)
        tmp32 = tl.full([1], 0.85437, tl.float64)
        tmp33 = libdevice.pow(tmp32, tmp31)
        tmp34 = tl.full([1], 1.0, tl.float64)"""
    loaded = """
        tmp31 = tl.load(in_ptr7 + (0))
        tmp32 = tl.broadcast_to(tmp31, [XBLOCK])
        tmp38 = (tmp26 / tmp32)"""
    assert fake_h100.computes_pow(inlined) and not fake_h100.computes_pow(loaded)


def test_the_fake_gpu_is_refused_in_one_line_by_a_torch_without_cuda(tmp_path):
    if WHY is None:
        pytest.skip("this torch can compile for the fake GPU")
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--json", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout.startswith(f"gpu_compile: {WHY};") and "test_torch.sh 2.11.0" in \
        done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_backwards_stand_ins_are_built_once_and_a_broken_build_is_replaced(tmp_path):
    """fake_h100.native_env: the preloaded runtime shim reports one device; a second call reuses the build; a build
    left incomplete (a process stopped in it) is replaced, not trusted."""
    env = fake_h100.native_env(tmp_path)
    shim = env["LD_PRELOAD"].split()[0]
    count = ctypes.c_int(0)
    assert ctypes.CDLL(shim).cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value == 1
    built = Path(shim).parent
    stamp = (built / "libcuda.so.1").stat().st_mtime_ns
    assert fake_h100.native_env(tmp_path) == env and (built / "libcuda.so.1").stat().st_mtime_ns == stamp
    (built / "libcuda.so.1").unlink()
    assert fake_h100.native_env(tmp_path) == env and (built / "libcuda.so.1").exists()
    assert str(built) in env["LD_LIBRARY_PATH"].split(":")



# a child under the fake (fake_h100.install patches its process): three functions compiled for CUDA graphs, what the
# trees' recorder (fake_h100.CudaGraphs) makes of each
GRAPHS_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import fake_h100
mode = fake_h100.install()
import torch

class Counter(torch.nn.Module):  # a buffer bumped in the forward, as delayed float8's amaxes are
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x * 2

options = {"backend": "inductor", "mode": "reduce-overhead", "dynamic": True}
with mode, torch.device("cuda", 0):
    x = torch.zeros(64)
    bump = torch.compile(lambda t: t.add_(1) * 2, **options)  # its own input mutated: not static, no graph's output
    bump(x)
    z = bump(x)  # the trees say so once, and keep running it eagerly
    counter = Counter()
    counter.compile(**options)
    y = counter(x)
    torch.compile(lambda t: t.mul_(3), **options)(y)  # a captured graph's output, mutated: the trees' own memory
    torch.compile(lambda t: t.sub_(1), **options)(z)  # the output of a graph run eagerly: not the trees'
    torch.compile(lambda t: t * 2, **options)(x.as_strided((8, 8), (1, 1)))  # overlapping rows: skipped compiling
graphs = fake_h100.CUDA_GRAPHS
print("ROW " + json.dumps({"compiled": graphs.compiled, "graphs": graphs.graphs, "skips": graphs.skips}))
"""


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_the_fake_tells_a_graph_the_cuda_graph_trees_would_run_eagerly(tmp_path):
    """COMPILE=reduce-overhead on the fake (bench/fake_h100.py's CudaGraphs): every graph inductor hands to the trees
    is recorded, and torch's own check at a call skips the one that mutates an input that is neither static (a
    buffer) nor made by a captured graph, as the trees would on a GPU, running it eagerly; a graph inductor skips
    while compiling (an input whose rows overlap in memory) is never handed over, and its skip is recorded."""
    done = subprocess.run([sys.executable, "-c", GRAPHS_CHILD, str(ROOT / "bench")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    row = json.loads(done.stdout.split("ROW ", 1)[1])
    assert [(g["kind"], g["mutated_inputs"], g["calls"], g["eager"]) for g in row["graphs"]] == [
        ("inference", 1, 2, True), ("inference", 1, 1, False), ("inference", 1, 1, False),
        ("inference", 1, 1, True)], row
    # five compiled, one partition each (graph partition, torch 2.11's default); the last never handed over
    assert [(c["fail_reasons"], c["partitions"]) for c in row["compiled"]] == [([], 1)] * 4 + [
        (["complex memory overlap"], 1)], row
    mutated = [s for s in row["skips"] if s.startswith("skipping cudagraphs due to mutated inputs (1 instances)")]
    assert len(mutated) == 2 and len(row["skips"]) == 3, row
    assert row["skips"][2] == "skipping cudagraphs due to ['complex memory overlap']", row


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_the_float8_candidate_is_captured_whole_under_cuda_graphs(tmp_path):
    """COMPILE=reduce-overhead over the float8 candidate (delayed scaling, our attention, the lean norm, BIAS_GELU
    fused) with the model as one graph: inductor hands each of the step's graphs to the CUDA graph trees and none is
    skipped; the forward and the backward each mutate one amax of every float8 linear (the input's, the gradient's),
    all of them buffers, static to the trees. The bf16 step is the control (the H200 captured it: driver-graphs-opt)."""
    out, wide = tmp_path / "gpu_compile.json", tmp_path / "wide.json"
    layers = 2
    wide.write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 16,
                                "intermediate_size": 4096, "vocab_size": 1024}))
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--targets", "graphs-step",
                           "fp8-delayed-lean-norm-triton-biasgelu-graphs-step", "--bert-config", str(wide),
                           "--tokens", "4096", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["target"]: r for r in json.loads(out.read_text())["rows"]}
    for row in rows.values():
        assert row["compiled"] and row["cudagraph_skips"] == [], row
        # each compiled graph one partition, handed over whole: no op of ours (nor any other) is left between
        # partitions to run uncaptured
        assert all(c["partitions"] == 1 and not c["fail_reasons"] for c in row["cudagraph_compiled"]), row
        assert len(row["cudagraph_graphs"]) == len(row["cudagraph_compiled"]), row
        kinds = [g["kind"] for g in row["cudagraph_graphs"]]
        assert kinds.count("forward") == kinds.count("backward") >= 1 and all(g["calls"] for g in
                                                                               row["cudagraph_graphs"]), kinds
    fp8 = rows["fp8-delayed-lean-norm-triton-biasgelu-graphs-step"]["cudagraph_graphs"]
    assert sorted(g["mutated_inputs"] for g in fp8 if g["kind"] == "forward") == [0, 4 * layers], fp8
    assert sorted(g["mutated_inputs"] for g in fp8 if g["kind"] == "backward") == [0, 4 * layers], fp8
    assert all(g["mutated_inputs"] == 0 for g in rows["graphs-step"]["cudagraph_graphs"])


@pytest.mark.skipif(WHY is not None, reason=f"needs torch's CUDA build and Triton: {WHY}")
def test_combo_kernels_launch_the_float8_steps_small_kernels_together(tmp_path):
    """COMBO_KERNELS=1 (bert.model.compile.configure_inductor) on the float8 candidate per layer: most of the step's
    inductor launches move a few bytes (each linear's scales, amax records, the dropout seeds), and combined far
    fewer are launched; the GEMMs and our ops are the same calls."""
    out, wide = tmp_path / "gpu_compile.json", tmp_path / "wide.json"
    wide.write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
                                "intermediate_size": 4096, "vocab_size": 1024}))
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_compile.py"), "--targets",
                           "fp8-delayed-lean-norm-triton-biasgelu-layers-step",
                           "fp8-delayed-lean-norm-triton-biasgelu-combo-layers-step", "--bert-config", str(wide),
                           "--tokens", "4096", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    apart, combined = (r for r in json.loads(out.read_text())["rows"])
    assert apart["tiny_launches"] > apart["triton_launches"] / 2, apart  # most launches move under 1 MB
    # two layers: 103 launches to 52 (BERT-large's 24: 873 to 344), those under 1 MB fewer by more than half
    assert combined["triton_launches"] < 0.6 * apart["triton_launches"], (combined, apart)
    assert combined["tiny_launches"] < apart["tiny_launches"] / 2, (combined, apart)
    assert combined["unestimated_launches"] > 0 == apart["unestimated_launches"], combined  # the combo kernels
    assert combined["library_calls"] == apart["library_calls"] and combined["our_op_calls"] == apart["our_op_calls"]
