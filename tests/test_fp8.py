"""PRECISION=fp8 (bert.model.fp8): the checks that run before any work, the layers swapped, and a float8 layer's
output and input gradient against a float64 reference of dynamic per-tensor scaling.

The CPU cannot run float8 GEMMs, so the swapped model runs with torchao's `emulate` (fp32 GEMMs on the
float8-rounded operands). The tests that need torchao skip without it (it is not in the CPU install); with
it: `PYTHONPATH=<dir holding torchao> python -m pytest -q tests/test_fp8.py`. On a GPU the CUDA test at the
end runs the real float8 GEMMs.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from bert.config import FP8_TOKEN_ALIGN, ConfigError, from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model.fp8 import (
    ALIGN,
    FP8_LINEAR_SETS,
    FP8_RECIPES,
    check_fp8,
    fp8_pattern,
    is_fp8_linear,
    torchao_release,
)
from bert.synthetic import random_batch

ROOT = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")
ENCODER_LINEARS = ("attention.self.qkv", "attention.output.dense", "intermediate.dense", "output.dense")


def has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


NEEDS_TORCHAO = pytest.mark.skipif(not has_torchao(), reason="torchao is not installed (not in the CPU install)")


def tiny_model(layers: int = 2, attention: str = "loop") -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = replace(BertConfig.load("tiny"), vocab_size=2000, real_vocab_size=1998, num_hidden_layers=layers)
    return BertForPreTraining(cfg.with_dropout(0.0), attention=attention)  # loop: the CPU, even where CUDA is


def test_fp8_without_a_float8_gpu_is_one_line_naming_the_setting(monkeypatch):
    check_fp8("bf16", CPU)  # other precisions: nothing to check
    with pytest.raises(ValueError, match=r"^PRECISION=fp8 needs a CUDA GPU of compute capability 8\.9") as e:
        check_fp8("fp8", CPU)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"^PRECISION=fp8 needs compute capability 8\.9 .* A100-SXM4-80GB is 8\.0"):
        check_fp8("fp8", torch.device("cuda"))


def test_fp8_without_torchao_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match=r"^PRECISION=fp8 needs torchao.*: pip install torchao==") as e:
        check_fp8("fp8", torch.device("cuda"))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch, "__version__", "2.10.0a0+b4e4ee81d3")  # NGC 25.12's torch
    with pytest.raises(ValueError, match=r"pip install torchao==0\.16\.0$"):
        check_fp8("fp8", torch.device("cuda"))


@pytest.mark.parametrize("version, release", [("2.10.0", "0.16.0"), ("2.10.0a0+b4e4ee81d3", "0.16.0"),
                                              ("2.11.0+cu130", "0.18.0"), ("2.13.0+cpu", "0.18.0")])
def test_the_torchao_release_named_is_the_one_each_torch_was_tested_with(version, release):
    # scripts/test_torch.sh ran the float8 tests with these pairs; 0.17 and 0.18 skip their C++ parts on 2.10
    assert torchao_release(version) == release


@pytest.mark.parametrize("path", ["Dockerfile", "scripts/test_torch.sh"])
def test_the_image_and_the_torch_venvs_install_the_torchao_release_named_for_their_torch(path):
    """The Dockerfile and scripts/test_torch.sh ask torchao_release() which torchao to install (TORCHAO written once,
    in bert.model.fp8): their command, run here, names the release for this torch, and neither pins one itself."""
    text = (ROOT / path).read_text()
    (command,) = re.findall(r"\$\([^)]*?python\S* -c '([^']+)'\)", text)
    out = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout == torchao_release(torch.__version__) + "\n"
    assert not re.search(r"TORCHAO=\S*\d", text)  # no default release of its own beside TORCHAO's


def test_fp8_config_needs_token_counts_the_float8_gemms_accept():
    assert FP8_TOKEN_ALIGN == ALIGN  # bert.config is torch-free: it keeps its own copy
    base = dict(input_dir="d", eval_dir="e", train_batch_size=8, bert_config_path="tiny", learning_rate=1e-3,
                max_steps=10, precision="fp8")
    for static in (0, 40):
        with pytest.raises(ConfigError, match=r"\$STATIC_TOKENS.*multiple of 16 with PRECISION=fp8"):
            from_flat(**base, static_tokens=static).validate()
    from_flat(**base, static_tokens=128, division="closed").validate()  # the rules pre-approve fp8


def test_fp8_recipe_is_a_checked_selector_that_needs_fp8():
    base = dict(input_dir="d", eval_dir="e", train_batch_size=8, bert_config_path="tiny", learning_rate=1e-3,
                max_steps=10, static_tokens=128)
    assert from_flat(**base).model.fp8_recipe == "tensorwise"
    for recipe in FP8_RECIPES:
        from_flat(**base, precision="fp8", fp8_recipe=recipe).validate()
    with pytest.raises(ConfigError, match=r"\$FP8_RECIPE.*must be one of tensorwise, rowwise, rowwise-gw-hp, delayed"):
        from_flat(**base, precision="fp8", fp8_recipe="rowise").validate()
    with pytest.raises(ConfigError, match=r"\$FP8_RECIPE.*no effect without PRECISION=fp8"):
        from_flat(**base, precision="bf16", fp8_recipe="rowwise").validate()


def test_filter_takes_the_encoder_linears_and_rejects_misaligned_ones():
    names = [f"bert.encoder.layer.3.{s}" for s in ENCODER_LINEARS]
    assert all(fp8_pattern().search(n) for n in names)
    assert all(fp8_pattern().search(f"bert.encoder.layer.23.{s}") for s in ENCODER_LINEARS)  # BERT-large's last
    heads = ["bert.pooler.dense", "cls.predictions.transform.dense", "cls.seq_relationship",
             "bert.encoder.layer.0.attention.output.LayerNorm"]
    assert not any(fp8_pattern().search(n) for n in heads)
    assert is_fp8_linear(nn.Linear(32, 64), names[0]) and not is_fp8_linear(nn.Linear(32, 64), heads[0])
    with pytest.raises(ValueError, match=r"^PRECISION=fp8: bert\.encoder\.layer\.3\.output\.dense .* multiples of 16"):
        is_fp8_linear(nn.Linear(24, 16), names[3])


def test_fp8_linears_selects_a_subset_of_each_layers_linears():
    """FP8_LINEARS: `ffn` takes the two FFN linears of every layer, `ffn-qkv` adds QKV; the attention output (whose
    name also ends in output.dense) only with `all`."""
    model = tiny_model()
    picked = {s: [n for n, m in model.named_modules() if is_fp8_linear(m, n, s)] for s in FP8_LINEAR_SETS}
    layer = lambda names: {n.split(".", 4)[-1] for n in names if n.startswith("bert.encoder.layer.1.")}  # noqa: E731
    assert layer(picked["all"]) == set(ENCODER_LINEARS)
    assert layer(picked["ffn"]) == {"intermediate.dense", "output.dense"}
    assert layer(picked["ffn-qkv"]) == {"attention.self.qkv", "intermediate.dense", "output.dense"}
    assert all(len(v) == 2 * len(FP8_LINEAR_SETS[s]) for s, v in picked.items())  # both layers of the tiny model
    base = dict(input_dir="d", eval_dir="e", train_batch_size=8, bert_config_path="tiny", learning_rate=1e-3,
                max_steps=10, static_tokens=128)
    from_flat(**base, precision="fp8", fp8_linears="ffn").validate()
    with pytest.raises(ConfigError, match=r"\$FP8_LINEARS = 'ffn' has no effect without PRECISION=fp8"):
        from_flat(**base, precision="bf16", fp8_linears="ffn").validate()
    with pytest.raises(ConfigError, match=r"\$FP8_LINEARS = 'fnn' must be one of all, ffn, ffn-qkv"):
        from_flat(**base, precision="fp8", fp8_linears="fnn").validate()


@NEEDS_TORCHAO
def test_conversion_swaps_exactly_the_encoder_linears_and_keeps_the_parameters():
    from torchao.float8.float8_linear import Float8Linear

    from bert.model.fp8 import convert_to_fp8

    model = tiny_model()
    params = dict(model.named_parameters())
    swapped = convert_to_fp8(model, emulate=True)
    expected = [f"bert.encoder.layer.{i}.{s}" for i in range(2) for s in ENCODER_LINEARS]
    assert sorted(swapped) == sorted(expected)
    float8 = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert float8 == sorted(expected)
    assert type(model.bert.pooler.dense) is nn.Linear and type(model.cls.seq_relationship) is nn.Linear
    assert type(model.cls.predictions.transform.dense) is nn.Linear
    after = dict(model.named_parameters())  # same names and the same tensors: checkpoints, decay groups, DDP
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)
    ffn = tiny_model()
    assert sorted(convert_to_fp8(ffn, emulate=True, linears="ffn")) == sorted(
        f"bert.encoder.layer.{i}.{s}" for i in range(2) for s in ("intermediate.dense", "output.dense"))
    assert type(ffn.bert.encoder.layer[0].attention.output.dense) is nn.Linear


def quantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dynamic per-tensor scaling in float64: scale = max(dtype) / amax, round to `dtype`, unscale."""
    x = x.double()
    scale = (torch.finfo(dtype).max / x.abs().max()).float().double()  # torchao keeps the scale in fp32
    return (x * scale).to(dtype).double() / scale


@NEEDS_TORCHAO
def test_float8_layer_matches_a_float64_reference_of_scaled_float8():
    from bert.model.fp8 import convert_to_fp8

    torch.manual_seed(0)
    holder = nn.Module()
    holder.encoder = nn.Module()
    holder.encoder.layer = nn.ModuleList([nn.Module()])
    holder.encoder.layer[0].intermediate = nn.Module()
    holder.encoder.layer[0].intermediate.dense = linear = nn.Linear(64, 128)
    convert_to_fp8(holder, emulate=True)
    layer = holder.encoder.layer[0].intermediate.dense
    x = torch.randn(48, 64, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    w = linear.weight.detach()
    y_ref = quantized(x.detach(), e4m3) @ quantized(w, e4m3).T + linear.bias.detach().double()
    gx_ref = quantized(grad, e5m2) @ quantized(w, e4m3)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gx_ref, rtol=1e-5, atol=1e-5)
    exact = x.detach().double() @ w.double().T + linear.bias.detach().double()
    assert (y.double() - exact).abs().max() > 1e-3  # it did round to float8: the reference is not the identity


def one_float8_linear(recipe: str, fin: int = 64, fout: int = 128) -> tuple[nn.Module, nn.Linear]:
    """An encoder-named linear swapped by `convert_to_fp8` with `recipe` (emulated), and a copy of the original."""
    from bert.model.fp8 import convert_to_fp8

    torch.manual_seed(0)
    holder = nn.Module()
    holder.encoder = nn.Module()
    holder.encoder.layer = nn.ModuleList([nn.Module()])
    holder.encoder.layer[0].intermediate = nn.Module()
    holder.encoder.layer[0].intermediate.dense = nn.Linear(fin, fout)
    original = nn.Linear(fin, fout)
    original.load_state_dict(holder.encoder.layer[0].intermediate.dense.state_dict())
    convert_to_fp8(holder, emulate=True, recipe=recipe)
    return holder.encoder.layer[0].intermediate.dense, original


def rowwise_quantized(x: torch.Tensor) -> torch.Tensor:
    """float64 reference of torchao's rowwise cast: per row, scale = max(e4m3) / amax rounded down to a power of 2,
    the row scaled, rounded to e4m3 and scaled back."""
    x = x.double()
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(scale.float()))).double()
    return (x * scale).to(torch.float8_e4m3fn).double() / scale


@NEEDS_TORCHAO
@pytest.mark.parametrize("recipe", ("rowwise", "rowwise-gw-hp"))
def test_rowwise_recipes_match_a_float64_reference_of_per_row_scales(recipe):
    """The forward of both rowwise recipes against per-row power-of-2 scaling of input and weight; the weight
    gradient of rowwise-gw-hp is the high-precision product (grad^T x), that of the others is not."""
    layer, original = one_float8_linear(recipe)
    x = torch.randn(48, 64, requires_grad=True)
    x.data[5] *= 300  # an outlier row: its own scale, the other rows theirs
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    w, b = original.weight.detach(), original.bias.detach().double()
    want = rowwise_quantized(x.detach()) @ rowwise_quantized(w).T + b
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    exact_gw = grad.double().T @ x.detach().double()
    gw_error = (layer.weight.grad.double() - exact_gw).abs().max() / exact_gw.abs().max()
    assert (gw_error < 1e-6) if recipe == "rowwise-gw-hp" else (gw_error > 1e-3), gw_error


@NEEDS_TORCHAO
def test_float8_model_trains_under_bf16_autocast():
    """The swapped model's forward and backward under bf16 autocast: a loss near the unconverted model's (not
    equal: the encoder GEMMs rounded to float8) and a gradient for every parameter. (COMPILE with float8 is
    checked on the GPU: dynamo tracing torchao's tensor subclass takes minutes on 2 cores.)"""
    from bert.model.fp8 import convert_to_fp8

    batch = random_batch([32, 16, 48, 32], seed=0, vocab_size=1998)

    def loss_and_grads(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch).loss
        loss.backward()
        return loss.detach().float(), [p.grad for p in model.parameters()]

    plain, _ = loss_and_grads(tiny_model(1))
    model = tiny_model(1)
    convert_to_fp8(model, emulate=True)
    loss, grads = loss_and_grads(model)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert abs(loss - plain) < 0.02 * plain and loss != plain, (loss, plain)


@NEEDS_TORCHAO
def test_float8_model_with_master_weights_runs_on_bf16_weights():
    """MASTER_WEIGHTS=1 with PRECISION=fp8, as the submissions run float8 (bf16 weights, fp32 masters in the
    optimizer): every weight of the converted model, the float8 linears' included, becomes bf16; forward and
    backward run without autocast, with a loss near the autocast run's over fp32 weights (the same float8 GEMMs,
    the rest bf16 either way, not the same bits) and bf16 gradients; a step leaves the weights equal to the fp32
    masters rounded to bf16."""
    from torchao.float8.float8_linear import Float8Linear

    from bert.model.fp8 import convert_to_fp8
    from bert.model.precision import autocast_dtype, compute_dtype
    from bert.optim import build_optimizer

    batch = random_batch([32, 16, 48, 32], seed=0, vocab_size=1998)
    autocast = tiny_model(1)
    convert_to_fp8(autocast, emulate=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = autocast(batch).loss.detach().float()
    model = tiny_model(1)
    convert_to_fp8(model, emulate=True)
    cfg = from_flat(input_dir="d", eval_dir="e", train_batch_size=4, bert_config_path="tiny", max_steps=10,
                    learning_rate=1e-2, precision="fp8", static_tokens=128, master_weights=True)
    optimizer = build_optimizer(model, cfg.optim, compute_dtype("fp8"))
    assert autocast_dtype("fp8", master_weights=True) is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 4
    loss = model(batch).loss
    loss.backward()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(loss.detach().float() - want) < 0.02 * want and loss.dtype == torch.float32, (loss, want)
    start = [m.clone() for m in optimizer.masters]
    optimizer.step()
    weights = [p for group in optimizer.param_groups for p in group["params"]]  # the masters' order
    for p, master in zip(weights, optimizer.masters, strict=True):
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))
    assert all(not torch.equal(m, s) for m, s in zip(optimizer.masters, start))  # every master took the step


def test_run_and_time_stops_before_the_timing_run_with_one_line(tmp_path):
    from test_harness import ROOT, config_env

    env = config_env("config_CPU_1x2.sh", PRECISION="fp8", STATIC_TOKENS="128", OUTPUT_DIR=str(tmp_path / "out"),
                     CUDA_VISIBLE_DEVICES="")  # a GPU machine too: the message for a node without one
    out = subprocess.run([str(ROOT / "run_and_time.sh")], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "PRECISION=fp8 needs a CUDA GPU" in out.stderr, out.stderr
    assert "STARTING TIMING RUN" not in out.stdout


FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.skipif(
    not FLOAT8_GPU or (r != "delayed" and not has_torchao()), reason="needs a GPU of compute capability >= 8.9 "
    "(and torchao, but for delayed)")) for r in FP8_RECIPES])
def test_cuda_float8_step_is_close_to_bf16(recipe):
    """BERT-tiny on the GPU, real float8 GEMMs (tokens padded to 128), each FP8_RECIPE: loss within 2 % of bf16,
    finite grads."""
    from bert.model.fp8 import convert_to_fp8
    from bert.static_shapes import MASKED_BUCKET, pad_to_buckets

    cuda = torch.device("cuda")
    batch = pad_to_buckets(random_batch([100, 37, 64, 200], seed=0, vocab_size=1998).to(cuda), 128, MASKED_BUCKET)
    losses = []
    for fp8 in (False, True):
        model = tiny_model(attention="varlen").to(cuda)
        if fp8:
            convert_to_fp8(model, recipe=recipe)
        if fp8 and recipe == "delayed":  # its scales come from a previous step: the driver's warm-up makes one
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(batch).loss.backward()
            model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0]


def test_fp8_linear_bench_table_and_json(tmp_path, capsys, monkeypatch):
    """bench/fp8_linear.py on the CPU: a row per encoder linear and layer kind (float8 ones, emulated, only with
    torchao), each against bf16; a token count float8 GEMMs cannot take is refused."""
    from script_modules import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the script imports bench/model.py
    bench = load_script("bench/fp8_linear.py")
    out = tmp_path / "fp8_linear.json"
    # the fewest tokens a float8 GEMM takes: the CPU has no fast bf16 GEMM, and the table's form does not depend on them
    assert bench.main(["--tokens", "16", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    kinds = list(bench.LAYERS) if has_torchao() else ["bf16"]
    assert [(r["layer"], r["variant"]) for r in report["rows"]] == [(n, k) for n in bench.SHAPES for k in kinds]
    assert all(r["speedup_vs_bf16"] == 1.0 for r in report["rows"] if r["variant"] == "bf16")
    assert report["emulated"] == has_torchao() and all(r["median_ms"] > 0 for r in report["rows"])
    printed = capsys.readouterr()
    assert "vs bf16" in printed.out and ("torchao is not installed" in printed.err) != has_torchao()
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "50"])
