"""Compile the driver's GPU graphs for an H100 on this CPU (bench/fake_h100.py): does each compile, how many Triton
kernels, how long, and what a training step's graphs launch. A compile that fails on the GPU (torch 2.11's inductor on
the flat LAMB update did, on an H100 and an H200) fails here the same way, before device time is spent on it.

Each target runs in a process of its own with an empty inductor cache, built as the driver builds it
(`build_model`, `build_optimizer`, `compile_step`: BERT `--bert-config`, bf16 weights with fp32 masters, LAMB,
flash varlen attention) under a fake CUDA device, and "runs" a forward and backward on a batch of `--tokens` tokens
(the H100 profile's batch of 96 had 24,405), a forward alone, or an optimizer step: the graphs are compiled as on the
GPU, and nothing is computed. A step target's row counts what its graphs launched: Triton kernels and inductor's
estimate of the bytes they read and write (`triton_gb`; at an H100's 3.35 TB/s, `triton_ms` is the least time
they take), launches of row kernels that store a tensor transposed (`strided`: a sector per element, which the
estimate does not see; fake_h100.strided_row_stores), launches of kernels computing a power (`pow`: where LAMB's
bias corrections were inlined per element; bert.optim.bias_correction), launches of kernels that store one value
twice through two pointers (`twice`: two buffers of one tensor; fake_h100.duplicate_stores), library calls (GEMMs)
by name, and our
custom ops' calls with the bytes of the tensors each takes and makes (`ours`: flash attention's, the fused residual
LayerNorm's). The estimate is inductor's: each kernel's buffers, counted once; attention and the GEMMs are not in
it. An update target takes gradients made as zeros of the parameters' shapes.
Needs torch's CUDA build and a C compiler (the backward's stand-ins, fake_h100.native_env):

    .venv-torch2.11.0-py3.12/bin/python bench/gpu_compile.py --targets model-step fp8-delayed-layers-step

Targets (`TARGETS`): the update alone (the model eager), the model's forward alone (in training mode, or as the
evaluation runs it), or its forward and backward (the update eager, not run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # fake_h100

# the candidates of each precision (every pass of ours, the lean norm), per layer; the targets built on them vary
# the scope, the compile mode or COMBO_KERNELS
BF16_CANDIDATE = {"compile": "default", "compile_scope": "layers", "residual_norm": "fused-lean", "attention": "triton",
                  "bias_gelu": "fused"}
FP8_CANDIDATE = {**BF16_CANDIDATE, "precision": "fp8", "fp8_recipe": "delayed", "static_tokens": 512}
FP8_CANDIDATE_GRAPHS = {**FP8_CANDIDATE, "compile": "reduce-overhead", "compile_scope": "model"}
TARGETS = {  # name: (the driver's settings, what is compiled)
    "flat-update": ({"optimizer_layout": "flat", "compile_optimizer": True}, "update"),
    # the same graph with inductor's own options, without compile_step's loop-ordering workaround
    "flat-update-inductor-options": ({"optimizer_layout": "flat", "compile_optimizer": True}, "update-defaults"),
    # the graph the H100 and H200 failed on (2026-11-26): the gradients' cast into the flat buffer inside it
    "flat-update-cast-in-graph": ({"optimizer_layout": "flat", "compile_optimizer": True}, "update-cast-in-graph"),
    "tensors-update": ({"optimizer_layout": "tensors", "compile_optimizer": True}, "update"),
    "model-forward": ({"compile": "default", "compile_scope": "model"}, "model"),
    "layers-forward": ({"compile": "default", "compile_scope": "layers"}, "model"),
    "fp8-delayed-layers-forward": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                            "fp8_recipe": "delayed", "static_tokens": 512}, "model"),
    # a training step's forward and backward (the update eager, not run): the driver's graphs, and what they launch
    "model-step": ({"compile": "default", "compile_scope": "model"}, "step"),
    "layers-step": ({"compile": "default", "compile_scope": "layers"}, "step"),
    "fp8-delayed-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                 "fp8_recipe": "delayed", "static_tokens": 512}, "step"),
    # each sublayer's bias + dropout + residual + LayerNorm our kernels (bert.model.dropout_add_norm): opaque to
    # inductor, so their bytes are not in its estimate (the row's `our_op_gb` counts them)
    "fused-norm-layers-step": ({"compile": "default", "compile_scope": "layers", "residual_norm": "fused"}, "step"),
    # attention through our Triton kernels (bert.model.triton_attention), opaque to inductor as flash's op is
    "triton-attention-layers-step": ({"compile": "default", "compile_scope": "layers", "attention": "triton"}, "step"),
    # both: the candidate fastest bf16 layer (driver-compiled-opt-norm-triton)
    "fused-norm-triton-attention-layers-step": ({"compile": "default", "compile_scope": "layers",
                                                 "residual_norm": "fused", "attention": "triton"}, "step"),
    # all three of our kernels' settings: the candidate fastest bf16 layer (driver-compiled-opt-norm-triton-biasgelu)
    "norm-triton-biasgelu-layers-step": ({"compile": "default", "compile_scope": "layers", "residual_norm": "fused",
                                          "attention": "triton", "bias_gelu": "fused"}, "step"),
    # the same with RESIDUAL_NORM=fused-lean: each norm's backward from its output, no sum written
    "lean-norm-triton-biasgelu-layers-step": (BF16_CANDIDATE, "step"),
    # GELU=rational (bert.model.gelu): its autograd Function inside the driver's one graph, dynamic over the tokens
    "rational-gelu-model-step": ({"compile": "default", "compile_scope": "model", "gelu": "rational"}, "step"),
    # BIAS_GELU=fused (bert.model.bias_gelu): the FFN's bias and GELU in our kernels, the bias gradient summed there
    "fused-bias-gelu-model-step": ({"compile": "default", "compile_scope": "model", "bias_gelu": "fused"}, "step"),
    "fused-bias-gelu-layers-step": ({"compile": "default", "compile_scope": "layers", "bias_gelu": "fused"}, "step"),
    # delayed float8 beside our kernels: opaque to inductor, each of their outputs a linear reads is cast in a pass
    # of its own, where inductor's own LayerNorm, GELU or attention output would take the cast into its kernel
    "fp8-delayed-triton-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                        "fp8_recipe": "delayed", "static_tokens": 512, "attention": "triton"},
                                       "step"),
    "fp8-delayed-norm-triton-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                             "fp8_recipe": "delayed", "static_tokens": 512, "attention": "triton",
                                             "residual_norm": "fused"}, "step"),
    # BIAS_GELU=fused under delayed float8 (bert.model.fp8_bias_gelu): the float8 FFN's GELU backward, its
    # gradient's cast, amax and bias sums in one pass of ours
    "fp8-delayed-biasgelu-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                          "fp8_recipe": "delayed", "static_tokens": 512, "bias_gelu": "fused"},
                                         "step"),
    "fp8-delayed-triton-biasgelu-layers-step": ({"compile": "default", "compile_scope": "layers",
                                                 "precision": "fp8", "fp8_recipe": "delayed", "static_tokens": 512,
                                                 "attention": "triton", "bias_gelu": "fused"}, "step"),
    # RESIDUAL_NORM=fused under delayed float8 (bert.model.fp8_residual_norm): the dense layer's output gradient
    # cast to float8, its amax and bias sums in the norm backward's pass of ours
    "fp8-delayed-norm-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                      "fp8_recipe": "delayed", "static_tokens": 512, "residual_norm": "fused"},
                                     "step"),
    # all three of our kernels' settings under delayed float8: the candidate fastest float8 layer
    "fp8-delayed-norm-triton-biasgelu-layers-step": ({"compile": "default", "compile_scope": "layers",
                                                      "precision": "fp8", "fp8_recipe": "delayed",
                                                      "static_tokens": 512, "attention": "triton",
                                                      "residual_norm": "fused", "bias_gelu": "fused"}, "step"),
    # the same with RESIDUAL_NORM=fused-lean: each norm's backward from its output, no sum written
    "fp8-delayed-lean-norm-triton-biasgelu-layers-step": (FP8_CANDIDATE, "step"),
    "fp8-tensorwise-layers-step": ({"compile": "default", "compile_scope": "layers", "precision": "fp8",
                                    "fp8_recipe": "tensorwise", "static_tokens": 512}, "step"),
    # the float8 candidate as the driver runs it (driver-fp8-delayed-lean-norm-triton-biasgelu): the model as one
    # graph, where the rows above compile each layer apart
    "fp8-delayed-lean-norm-triton-biasgelu-model-step": ({**FP8_CANDIDATE, "compile_scope": "model"}, "step"),
    # under CUDA graphs (COMPILE=reduce-overhead): does inductor hand every graph to its CUDA graph trees, or skip
    # one, and why (fake_h100.CudaGraphs)? bf16 first, as driver-graphs-opt ran it on an H200 (785 samples/s)
    "graphs-step": ({"compile": "reduce-overhead", "compile_scope": "model", "static_tokens": 512}, "step"),
    "fp8-delayed-lean-norm-triton-biasgelu-graphs-step": (FP8_CANDIDATE_GRAPHS, "step"),
    # its evaluation: the model in eval mode without grad (an inference graph: no dropout, no amax recorded)
    "fp8-delayed-lean-norm-triton-biasgelu-graphs-eval": (FP8_CANDIDATE_GRAPHS, "eval"),
    # COMBO_KERNELS=1 (bert.model.compile.configure_inductor): inductor's independent small kernels launched as one
    # (a combo kernel carries no byte estimate: its launches count as unestimated, its bytes are its parts')
    "fp8-delayed-lean-norm-triton-biasgelu-combo-layers-step": ({**FP8_CANDIDATE, "combo_kernels": True}, "step"),
    "fp8-delayed-lean-norm-triton-biasgelu-combo-graphs-step": ({**FP8_CANDIDATE_GRAPHS, "combo_kernels": True},
                                                                "step"),
    "lean-norm-triton-biasgelu-combo-layers-step": ({**BF16_CANDIDATE, "combo_kernels": True}, "step"),
    "combo-model-step": ({"compile": "default", "compile_scope": "model", "combo_kernels": True}, "step"),
    "tensors-update-combo": ({"optimizer_layout": "tensors", "compile_optimizer": True, "compile": "default",
                              "combo_kernels": True}, "update"),
}
H100_TB_S = 3.35  # an H100 SXM's memory bandwidth: GB / (TB/s) = ms

# a row that fails on torch 2.11 by design (the GPUs' failure, reproduced here): it does not make the exit status
# non-zero
EXPECTED_TO_FAIL = ("flat-update-cast-in-graph",)


def innermost(tb: str) -> str:
    """The last frame of torch's or Triton's code in a traceback: where the compile failed."""
    frames = [line.strip() for line in tb.splitlines() if line.strip().startswith("File ")]
    ours = [f for f in frames if "/torch/" in f or "/triton/" in f]
    return (ours or frames or ["?"])[-1]


def run_target(name: str, bert_config: str, tokens: int) -> dict:
    import fake_h100

    mode = fake_h100.install()
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    from bert.config import from_flat
    from bert.model.compile import CUDA_GRAPH_MODES
    from bert.optim import build_optimizer
    from bert.optim.compiled import compile_step
    from bert.synthetic import random_batch
    from bert.train.build import build_model

    settings, what = TARGETS[name]
    cfg = from_flat(**{"bert_config_path": bert_config, "attention": "varlen", "master_weights": True,
                       "precision": "bf16", "grad_clip": "after", "learning_rate": 1e-3, "max_steps": 1000,
                       "weight_decay_rate": 0.01, **settings})
    device = torch.device("cuda", 0)
    start = time.perf_counter()
    row = {"target": name, "bert_config": bert_config, "torch": torch.__version__, "tokens": tokens}
    try:
        with mode, device:
            torch.manual_seed(0)
            model = build_model(cfg.model, device)
            opt = build_optimizer(model, cfg.optim, torch.bfloat16)
            if what == "update":
                compile_step(opt, "default")
            elif what == "update-defaults":
                opt.update_masters = torch.compile(opt.update_masters, backend="inductor")
            elif what == "update-cast-in-graph":
                update = opt.update_masters

                def cast_and_update(params, masters, inv_scale, found_inf):
                    torch._foreach_copy_(opt.inner.grad_views, [p.grad for p in params])
                    update(params, masters, inv_scale, found_inf)

                opt.update_masters = torch.compile(cast_and_update, backend="inductor")
            lengths, left = [], tokens  # phase-2-like sequences of at most 512 tokens
            while left > 0:
                lengths.append(min(left, 128 + 97 * len(lengths) % 385))
                left -= lengths[-1]
            batch = random_batch(tuple(lengths), seed=0, vocab_size=model.config.vocab_size).to(device)
            fake_h100.LAUNCHES.reset()  # what this target's graphs launch, without the batch's making
            if what in ("model", "eval"):
                model.train(what == "model")
                with torch.no_grad():
                    model(batch)
            elif what == "step":
                if not fake_h100.backward_ready():
                    raise RuntimeError("a backward needs fake_h100.native_env's stand-ins (a C compiler, cc)")
                model(batch).loss.backward()
            else:
                for param in model.parameters():  # the backward's gradients, in metadata only
                    param.grad = torch.zeros_like(param)
                # two steps, as bert.optim.compiled.warm_up_step: the first creates the state, and the second
                # compiles the graph every later step runs (cast-in-graph: step's eager cast runs too, and the
                # graph casts again, as before)
                opt.step()
                fake_h100.LAUNCHES.reset()  # what each later step launches
                opt.step()
        row.update(compiled=True, error=None, where=None)
    except Exception as e:  # the row says what failed and where; the table goes on
        row.update(compiled=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                   where=innermost(traceback.format_exc()))
    launched = fake_h100.LAUNCHES
    row.update(seconds=round(time.perf_counter() - start, 1), triton_kernels=metrics.generated_kernel_count,
               graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
               triton_launches=launched.triton, triton_gb=round(launched.triton_gb, 3),
               triton_ms=round(launched.triton_gb / H100_TB_S, 2),
               unestimated_launches=launched.unestimated, library_calls=dict(launched.library),
               aten_calls=dict(launched.aten.most_common()),
               aten_gb={k: round(v, 3) for k, v in launched.aten_gb.most_common()},
               our_op_calls=dict(launched.ours.most_common()),
               our_op_gb={k: round(v, 3) for k, v in launched.ours_gb.most_common()},
               top_kernels_gb={k: round(v, 3) for k, v in launched.gb_by_kernel.most_common(12)},
               tiny_launches=launched.tiny,
               launches_by_kernel=dict(launched.launches_by_kernel.most_common()),
               gb_by_kernel={k: round(v, 6) for k, v in launched.gb_by_kernel.items()},
               strided_store_launches=sum(launched.strided.values()), strided_store_kernels=dict(launched.strided),
               pow_launches=sum(launched.pow.values()), pow_kernels=dict(launched.pow),
               duplicate_store_launches=sum(launched.duplicate.values()),
               duplicate_store_kernels=dict(launched.duplicate))
    if settings.get("compile") in CUDA_GRAPH_MODES:  # what the CUDA graph trees would capture, and what they skip
        graphs = fake_h100.CUDA_GRAPHS
        row.update(cudagraph_compiled=graphs.compiled, cudagraph_graphs=graphs.graphs, cudagraph_skips=graphs.skips)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--bert-config", default="large")
    p.add_argument("--tokens", type=int, default=24576, help="tokens in the one batch (a multiple of 512)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per target")
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "gpu_compile.json"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # a target in this process (the parent's child)
    args = p.parse_args()
    if args.one:
        print("ROW " + json.dumps(run_target(args.one, args.bert_config, args.tokens)))
        return 0
    import fake_h100

    why = fake_h100.usable()
    if why:
        print(f"gpu_compile: {why}; run it with torch's CUDA build (bash scripts/test_torch.sh 2.11.0 makes one)")
        return 2
    native = fake_h100.stand_ins()  # the backward's; without a C compiler the step targets fail, each saying so
    rows = []
    for name in args.targets:
        row = fake_h100.run_cold([sys.executable, __file__, "--one", name, "--bert-config", args.bert_config,
                                  "--tokens", str(args.tokens)],
                                 {**os.environ, "PYTHONPATH": str(ROOT), **native}, args.timeout)
        row = {"target": name, "compiled": False, **row}  # a failed child's row: its error alone
        rows.append(row)
        kernels, seconds, graphs = row.get("triton_kernels", "-"), row.get("seconds", "-"), row.get("graphs", "-")
        launched = (f"{row['triton_launches']:5} launches ({row['tiny_launches']} tiny, "
                    f"{row['unestimated_launches']} unestimated) {row['triton_gb']:6.1f} GB {row['triton_ms']:5.1f} ms "
                    f"{row['strided_store_launches']:4} strided {row['pow_launches']:4} pow "
                    f"{row['duplicate_store_launches']:4} twice "
                    f"{sum(row.get('our_op_gb', {}).values()):5.1f} GB ours"
                    if row.get("triton_launches") else f"{'':55}")
        print(f"{row['target']:28} {'compiled' if row['compiled'] else 'FAILED':9} {graphs!s:>2} graphs "
              f"{row.get('graph_breaks', '-')!s:>2} breaks {kernels!s:>4} kernels {seconds!s:>5} s {launched}  "
              f"{row.get('error') or ''}")
        if "cudagraph_graphs" in row:
            kinds = collections.Counter(g["kind"] for g in row["cudagraph_graphs"])
            parts = sum(c["partitions"] or 1 for c in row["cudagraph_compiled"])
            print(f"{'':28} CUDA graphs: {len(row['cudagraph_compiled'])} compiled graphs in {parts} partitions, "
                  f"{dict(kinds)} handed to the trees, {len(row['cudagraph_skips'])} skipped")
            for reason in row["cudagraph_skips"]:
                print(f"{'':28}   {reason.splitlines()[0][:200]}")
        if row.get("where"):
            print(f"{'':28} at {row['where']}")
    import torch

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(),
                                           "torch": torch.__version__, "fake_gpu": "H100 (bench/fake_h100.py)",
                                           "rows": rows}, indent=1) + "\n")
    return 0 if all(r["compiled"] for r in rows if r["target"] not in EXPECTED_TO_FAIL) else 1


if __name__ == "__main__":
    sys.exit(main())
