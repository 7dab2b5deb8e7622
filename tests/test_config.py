"""The config: sections, flag and variable names, selectors validated against the registries, numbers
bounded, builders fed one section, and no package below `bert.train` importing the trainer."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert.balance import STRATEGIES
from bert.config import (
    SECTIONS,
    ConfigError,
    TrainConfig,
    config_fields,
    from_env_and_args,
    from_flat,
    registry_names,
)
from bert.dist.clip import CLIP_MODES
from bert.dist.compress import COMM_DTYPES
from bert.dist.ddp import GRAD_BUCKETS
from bert.dist.reduce import REDUCTIONS
from bert.model.attention import BACKENDS
from bert.model.bias_gelu import BIAS_GELUS
from bert.model.dropout_add_norm import RESIDUAL_NORMS
from bert.model.gelu import GELUS
from bert.optim import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1]
BASE = {"DATADIR_PHASE2": "x", "EVALDIR": "x", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
        "MAX_STEPS": "10"}
# Every variable and flag the driver read before the config was split into sections (none may go).
ENV_NAMES = {
    "DATADIR_PHASE2", "EVALDIR", "OUTPUT_DIR", "MAX_SEQ_LENGTH", "MAX_PRED", "NUM_EVAL_EXAMPLES", "EVAL_BATCHSIZE",
    "BALANCE", "SHUFFLE_BUFFER", "BERT_CONFIG", "INIT_CHECKPOINT", "ATTENTION", "PRECISION", "INIT_LOSS_SCALE",
    "BATCHSIZE", "GRADIENT_STEPS", "OPTIMIZER", "LR", "OPT_LAMB_BETA_1", "OPT_LAMB_BETA_2", "EPSILON",
    "WEIGHT_DECAY_RATE", "WARMUP_STEPS", "START_WARMUP_STEP", "MAX_STEPS", "LR_MAX_STEPS", "END_LR", "LR_POLY_POWER",
    "GRAD_CLIP", "MAX_GRAD_NORM", "BUCKET_CAP_MB", "SEED", "MAX_SAMPLES_TERMINATION", "EVAL_ITER_START_SAMPLES",
    "EVAL_ITER_SAMPLES", "TARGET_MLM_ACCURACY", "LOG_FREQ", "CHECKPOINT_EVERY", "SKIP_CHECKPOINT", "RESUME",
    "STEPS_THIS_JOB", "DIST_TIMEOUT", "MLPERF_LOG", "CACHE_CLEARED", "MLPERF_DIVISION", "MLPERF_ORG", "DGXSYSTEM",
    "MLPERF_STATUS", "PEAK_TFLOPS", "GRAD_REDUCE", "PS_SERVERS", "OPTIMIZER_SHARDING", "GRAD_BUCKETS",
    "GRAD_COMM_DTYPE", "GRAD_REDUCE_NODE_SIZE", "COMPILE", "STATIC_TOKENS", "COMPILE_OPTIMIZER", "MASTER_WEIGHTS",
}


def parse(**env: str) -> TrainConfig:
    return from_env_and_args([], {**BASE, **env})


def test_sections_keep_every_variable_and_flat_flag():
    fields = list(config_fields())
    assert [s for s in SECTIONS] == ["data", "model", "optim", "dist", "run", "log"]
    assert {f.metadata["env"] for _, f in fields if f.metadata["env"]} >= ENV_NAMES
    names = [f.name for _, f in fields]
    assert len(names) == len(set(names))  # flags stay flat: a name lives in exactly one section
    cfg = from_env_and_args(["--learning_rate", "0.5", "--balance", "samsung"], {**BASE, "LR": "0.25"})
    assert (cfg.optim.learning_rate, cfg.data.balance, cfg.data.train_batch_size) == (0.5, "samsung", 8)


def test_selector_choices_are_the_registries():
    by_env = {f.metadata["env"]: f for _, f in config_fields()}
    assert set(registry_names(by_env["BALANCE"].metadata["registry"])) == set(STRATEGIES)
    assert set(registry_names(by_env["ATTENTION"].metadata["registry"])) == {"auto", *BACKENDS}
    assert set(registry_names(by_env["OPTIMIZER"].metadata["registry"])) == set(OPTIMIZERS)
    assert set(registry_names(by_env["GRAD_CLIP"].metadata["registry"])) == set(CLIP_MODES)
    assert set(registry_names(by_env["GRAD_REDUCE"].metadata["registry"])) == set(REDUCTIONS)
    assert set(registry_names(by_env["GRAD_BUCKETS"].metadata["registry"])) == set(GRAD_BUCKETS)
    assert set(registry_names(by_env["GRAD_COMM_DTYPE"].metadata["registry"])) == set(COMM_DTYPES)
    assert set(registry_names(by_env["RESIDUAL_NORM"].metadata["registry"])) == set(RESIDUAL_NORMS)
    assert set(registry_names(by_env["GELU"].metadata["registry"])) == set(GELUS)
    assert set(registry_names(by_env["BIAS_GELU"].metadata["registry"])) == set(BIAS_GELUS)
    for name in [*STRATEGIES]:
        assert parse(BALANCE=name).data.balance == name


@pytest.mark.parametrize("env, culprit", [
    ({"BALANCE": "samsnug"}, "$BALANCE"),
    ({"ATTENTION": "flsh"}, "$ATTENTION"),
    ({"OPTIMIZER": "lamb2"}, "$OPTIMIZER"),
    ({"GRAD_CLIP": "bukcet"}, "$GRAD_CLIP"),
    ({"GRAD_REDUCE": "hierarchicl"}, "$GRAD_REDUCE"),
    ({"GRAD_REDUCE": "ps", "PS_SERVERS": "0"}, "$PS_SERVERS"),
    ({"GRAD_BUCKETS": "balnced"}, "$GRAD_BUCKETS"),
    ({"GRAD_COMM_DTYPE": "bf8"}, "$GRAD_COMM_DTYPE"),
    ({"GRAD_REDUCE_NODE_SIZE": "-2"}, "$GRAD_REDUCE_NODE_SIZE"),
    ({"GRAD_REDUCE": "hierarchical", "GRAD_REDUCE_NODE_SIZE": "3", "WORLD_SIZE": "4"}, "$GRAD_REDUCE_NODE_SIZE"),
    ({"COMPILE": "max_autotune"}, "$COMPILE"),
    ({"STATIC_TOKENS": "-512"}, "$STATIC_TOKENS"),
    ({"PRECISION": "bf61"}, "$PRECISION"),
    ({"OPTIMIZER_SHARDING": "maybe"}, "$OPTIMIZER_SHARDING"),
    ({"OPTIMIZER_LAYOUT": "flt"}, "$OPTIMIZER_LAYOUT"),
    ({"LOADER_WORKER": "procces"}, "$LOADER_WORKER"),
    ({"RESIDUAL_NORM": "fusd"}, "$RESIDUAL_NORM"),
    ({"GELU": "tanh"}, "$GELU"),  # the approximation BERT does not use
    ({"GELU": "rational"}, "$GELU"),  # eager: a dozen kernels each way
    ({"BIAS_GELU": "fusd"}, "$BIAS_GELU"),
    ({"BIAS_GELU": "fused", "PRECISION": "fp8"}, "$BIAS_GELU"),  # torchao's float8 linears keep their bias
    ({"OPTIMIZER_LAYOUT": "flat"}, "$OPTIMIZER_LAYOUT"),  # needs the masters
    ({"OPTIMIZER_LAYOUT": "flat", "MASTER_WEIGHTS": "1", "PRECISION": "bf16", "OPTIMIZER": "adam"},
     "$OPTIMIZER_LAYOUT"),
    ({"OPTIMIZER_SHARDING": "1", "GRAD_COMM_DTYPE": "bf16"}, "$GRAD_COMM_DTYPE"),
    ({"MLPERF_DIVISION": "closd"}, "$MLPERF_DIVISION"),
    ({"BATCHSIZE": "inf"}, "$BATCHSIZE"),
    ({"BATCHSIZE": "nan"}, "$BATCHSIZE"),
    ({"BATCHSIZE": "1e30"}, "$BATCHSIZE"),
    ({"BATCHSIZE": "4.5"}, "$BATCHSIZE"),  # not rounded to 4: a count written as 4.5e6 must be whole
    ({"LR": "nan"}, "$LR"),
    ({"LR": "inf"}, "$LR"),
    ({"LR": "-1e-3"}, "$LR"),
    ({"MAX_GRAD_NORM": "nan"}, "$MAX_GRAD_NORM"),
    ({"OPT_LAMB_BETA_2": "1.5"}, "$OPT_LAMB_BETA_2"),
    ({"TARGET_MLM_ACCURACY": "1.0"}, "$TARGET_MLM_ACCURACY"),
    ({"MAX_STEPS": "1e30"}, "$MAX_STEPS"),
    ({"SEED": "-1"}, "$SEED"),
    ({"PROFILE_FROM": "-1"}, "$PROFILE_FROM"),
    ({"PROFILE_FROM": "x"}, "$PROFILE_FROM"),
    ({"PROFILE_STEPS": "0"}, "$PROFILE_STEPS"),
])
def test_bad_values_are_config_errors_naming_the_variable(env, culprit):
    with pytest.raises(ConfigError) as e:
        parse(**env)
    assert culprit in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("graphs", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_attention_whose_shapes_follow_the_lengths_is_refused_under_cuda_graphs(graphs, backend):
    """grouped's per-group rows x width and loop's per-sequence lengths change with every batch, STATIC_TOKENS or
    not: a CUDA-graph mode would record a graph almost every step. One line naming both settings and what to use."""
    with pytest.raises(ConfigError) as e:
        parse(ATTENTION=backend, COMPILE=graphs, STATIC_TOKENS="512")
    assert str(e.value).startswith(f"config: --attention / $ATTENTION = '{backend}' cannot be combined with "
                                   f"COMPILE={graphs} (")
    assert str(e.value).endswith("use ATTENTION=varlen or padded with STATIC_TOKENS, or COMPILE=default")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["off", "debug"])
def test_combo_kernels_need_an_inductor_compile(mode):
    """COMBO_KERNELS is inductor's setting: with COMPILE=off nothing is compiled, and debug's aot_eager generates no
    kernels to combine. One line naming both settings; every inductor mode takes it."""
    with pytest.raises(ConfigError) as e:
        parse(COMBO_KERNELS="1", COMPILE=mode)
    assert str(e.value).startswith("config: --combo_kernels / $COMBO_KERNELS = True is inductor's and has no effect "
                                   f"with COMPILE={mode}") and "\n" not in str(e.value), str(e.value)
    for inductor in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        assert parse(COMBO_KERNELS="1", COMPILE=inductor).model.combo_kernels
    assert not parse(COMPILE="default").model.combo_kernels


def test_cuda_graphs_take_the_attention_backends_of_fixed_shapes():
    """auto (varlen on CUDA; loop only on the CPU, which records no graph), varlen, cudnn and padded pass, and
    grouped and loop pass without CUDA graphs."""
    for backend in ("auto", "varlen", "cudnn", "padded"):
        assert parse(ATTENTION=backend, COMPILE="reduce-overhead", STATIC_TOKENS="512").model.attention == backend
    for backend in ("grouped", "loop"):
        for mode in ("off", "default", "debug"):
            assert parse(ATTENTION=backend, COMPILE=mode).model.compile == mode


def test_optimizer_sharding_refuses_another_gradient_reduction(monkeypatch):
    """The sharded update's reduce-scatter is the reduction: GRAD_REDUCE must stay flat."""
    import bert.dist.reduce

    monkeypatch.setitem(bert.dist.reduce.REDUCTIONS, "hierarchical", lambda cfg, env: None)
    assert parse(OPTIMIZER_SHARDING="1", OPTIMIZER="adam").optim.optimizer_sharding is True
    assert parse(GRAD_REDUCE="hierarchical").dist.grad_reduce == "hierarchical"
    with pytest.raises(ConfigError) as e:
        parse(OPTIMIZER_SHARDING="1", GRAD_REDUCE="hierarchical")
    assert "$GRAD_REDUCE" in str(e.value) and "OPTIMIZER_SHARDING" in str(e.value) and "\n" not in str(e.value)


def test_check_env_fails_on_the_issues_typos_with_one_line_and_exit_2():
    env = {**os.environ, **BASE, "BALANCE": "samsnug", "ATTENTION": "flsh"}
    out = subprocess.run([sys.executable, "-m", "bert.train.config", "--check-env"], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "$BALANCE" in out.stderr and "samsnug" in out.stderr, out.stderr


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(torch_cuda_available(), reason="the CPU's answer")
@pytest.mark.parametrize("backend", ["varlen", "cudnn"])
def test_check_device_refuses_a_cuda_attention_backend_on_the_cpu(backend):
    """Before anything is logged (run_and_time.sh's check), not at the first forward inside the timed run."""
    env = {**os.environ, **BASE, "ATTENTION": backend, "PRECISION": "bf16"}  # bf16: only the device is wrong
    out = subprocess.run([sys.executable, "-m", "bert.train.config", "--check-env", "--check-device"], env=env,
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr == f"error: ATTENTION={backend} needs a CUDA device (this run's is " \
        "cpu): use ATTENTION=auto\n", out.stderr


@pytest.mark.skipif(torch_cuda_available(), reason="the CPU's answer")
def test_a_gpu_config_on_a_node_without_a_gpu_stops_before_anything_is_logged(tmp_path):
    """DEVICE=cuda (config_DGX_common.sh) on a node whose tasks see no GPU: run_and_time.sh's check and the driver
    itself each stop with one line, exit 2; the driver before it claims its result log."""
    env = {**os.environ, **BASE, "DEVICE": "cuda", "MLPERF_LOG": str(tmp_path / "result.txt")}
    check = subprocess.run([sys.executable, "-m", "bert.train.config", "--check-env", "--check-device"], env=env,
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 2 and check.stderr.startswith("error: DEVICE=cuda, but torch"), check.stderr
    assert len(check.stderr.splitlines()) == 1
    run = subprocess.run([sys.executable, "run_pretraining.py"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.startswith("error: rank 0: DEVICE=cuda, but torch"), run.stderr
    assert len(run.stderr.splitlines()) == 1 and not (tmp_path / "result.txt").exists()


def test_builders_take_their_section():
    import torch

    from bert.optim import build_optimizer, build_schedule

    cfg = from_flat(learning_rate=2e-3, max_steps=10, optimizer="adam", weight_decay_rate=0.0)
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, cfg.optim)
    schedule = build_schedule(opt, cfg.optim)
    assert isinstance(opt, torch.optim.AdamW) and float(schedule.lr) == pytest.approx(2e-3)
    with pytest.raises(TypeError):
        from_flat(learning_rat=1.0)  # a misspelled field is an error, not a silently ignored value


def _bert_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "bert" or n.startswith("bert.")}


def test_no_package_below_the_trainer_imports_it():
    """bert.train builds runs out of the other packages; none of them may reach back up."""
    offenders = []
    for path in (ROOT / "bert").rglob("*.py"):
        rel = path.relative_to(ROOT / "bert")
        if rel.parts[0] == "train":
            continue
        offenders += [f"{rel}: {m}" for m in _bert_imports(path) if m.startswith("bert.train")]
    assert offenders == []
    # torch-free: it imports the registries lazily, and of the package only the Slurm layout, itself torch-free
    assert _bert_imports(ROOT / "bert" / "config.py") == {"bert.dist.slurm"}
    assert _bert_imports(ROOT / "bert" / "dist" / "slurm.py") == set()
    out = subprocess.run([sys.executable, "-c", "import sys, bert.config; print('torch' in sys.modules)"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sections_are_dataclasses_with_defaults():
    cfg = TrainConfig()
    for name, cls in SECTIONS.items():
        assert dataclasses.is_dataclass(cls) and isinstance(getattr(cfg, name), cls)
    assert cfg.global_batch_size_per_rank == cfg.data.train_batch_size * cfg.optim.gradient_accumulation_steps


def test_bounds_are_inclusive_unless_open():
    """Each bound as the field states it: a value on an inclusive bound parses, on an open one it is refused (an
    epsilon, a clip threshold or a bucket of 0 would divide by zero or clip everything; a target of 0 is met at
    once)."""
    on_the_bound = {"OPT_LAMB_BETA_1": "1", "OPT_LAMB_BETA_2": "0", "WEIGHT_DECAY_RATE": "10", "LR": "1e6",
                    "BATCHSIZE": "65536", "SEED": "0", "WARMUP_STEPS": "0", "EPSILON": "1", "END_LR": "10"}
    cfg = parse(**on_the_bound)
    assert (cfg.optim.opt_lamb_beta_1, cfg.optim.weight_decay_rate, cfg.optim.learning_rate) == (1.0, 10.0, 1e6)
    assert (cfg.data.train_batch_size, cfg.run.seed) == (65536, 0)
    assert parse(SEED=str(2**63 - 1)).run.seed == 2**63 - 1
    for env, value, problem in (("EPSILON", "0", "must be > 0"), ("MAX_GRAD_NORM", "0", "must be > 0"),
                                ("BUCKET_CAP_MB", "0", "must be > 0"), ("TARGET_MLM_ACCURACY", "0", "must be > 0"),
                                ("BATCHSIZE", "65537", "must be <= 65536"), ("SEED", str(2**63), "must be <=")):
        with pytest.raises(ConfigError, match=re.escape(f"${env} = ") + ".*" + re.escape(problem)):
            parse(**{env: value})


@pytest.mark.parametrize("missing", ["DATADIR_PHASE2", "EVALDIR", "BERT_CONFIG", "BATCHSIZE", "LR", "MAX_STEPS"])
def test_a_required_setting_left_out_is_named(missing):
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=re.escape(f"${missing} = ") + ".*is required"):
        from_env_and_args([], env)
    with pytest.raises(ConfigError, match=re.escape(f"${missing} = ''")):  # set but empty, as a shell config may
        from_env_and_args([], {**env, missing: ""})


def test_booleans_in_any_case():
    for raw, want in (("1", True), ("True", True), ("YES", True), ("On", True), ("0", False), ("False", False),
                      ("NO", False), ("off", False), ("", False)):
        assert parse(SKIP_CHECKPOINT=raw).run.skip_checkpoint is want, raw
    with pytest.raises(ConfigError, match=r"\$SKIP_CHECKPOINT = '2' from \$SKIP_CHECKPOINT is not a valid bool"):
        parse(SKIP_CHECKPOINT="2")


def test_an_explicit_node_size_must_divide_the_world_whatever_the_reduction():
    """GRAD_REDUCE_NODE_SIZE set by hand is checked against the launcher's world under any GRAD_REDUCE (it states
    a layout); left at 0 it is checked only for hierarchical, the one reduction that uses nodes."""
    with pytest.raises(ConfigError, match=r"\$GRAD_REDUCE_NODE_SIZE = 3 does not divide the world size 4 "
                                          r"\(\$WORLD_SIZE\) into equal nodes for GRAD_REDUCE=flat"):
        parse(GRAD_REDUCE_NODE_SIZE="3", WORLD_SIZE="4")
    assert parse(GRAD_REDUCE_NODE_SIZE="2", WORLD_SIZE="4").dist.grad_reduce_node_size == 2
    assert parse(WORLD_SIZE="6", LOCAL_WORLD_SIZE="4").dist.grad_reduce == "flat"  # flat has no nodes


def test_check_env_checks_the_device_only_when_asked_and_prints_the_config_otherwise(monkeypatch, capsys):
    """run_and_time.sh passes --check-device; --check-env alone validates the settings (a login node without the
    job's GPU can check a CUDA-only ATTENTION); without --check-env the resolved config is printed, flags over
    variables."""
    import torch

    from bert.train.config import main

    for name, value in {**BASE, "ATTENTION": "varlen", "LR": "0.25"}.items():
        monkeypatch.setenv(name, value)
    assert main(["--check-env"]) == 0 and capsys.readouterr().out == "config OK\n"
    if not torch.cuda.is_available():
        assert main(["--check-env", "--check-device"]) == 2
        assert "ATTENTION=varlen needs a CUDA device" in capsys.readouterr().err
    assert main(["--learning_rate", "0.5", "--seed", "7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == list(SECTIONS)
    assert (printed["optim"]["learning_rate"], printed["run"]["seed"], printed["model"]["attention"]) == (
        0.5, 7, "varlen")
    assert printed["data"]["train_batch_size"] == 8


@pytest.mark.parametrize("version, ok", [("2.6.0a0+ecf3bae", False), ("2.9.1", False), ("1.13.1", False),
                                         ("2.10.0a0+b4e4ee81d3", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True),
                                         ("3.0.0", True)])
def test_a_torch_older_than_the_oldest_tested_is_one_line_before_anything_else(version, ok, monkeypatch, capsys):
    """2.6 (NGC 25.01) fails 8 tests of the model, compile, optimizer and reduction modules; 2.10 passes the suite
    (scripts/test_torch.sh; bert.train.config.MIN_TORCH). --check-env refuses an older one before reading any
    setting, from the package's metadata."""
    from bert.train import config

    monkeypatch.setattr(config.importlib.metadata, "version", lambda name: {"torch": version}[name])
    for name, value in BASE.items():
        monkeypatch.setenv(name, value)
    assert config.main(["--check-env"]) == (0 if ok else 2)
    out = capsys.readouterr()
    if ok:
        assert out.out == "config OK\n"
    else:
        assert out.err == f"error: torch {version} is older than 2.10, the oldest release this harness is tested " \
                          "on: use a newer image (the Dockerfile's BASE_IMAGE) or torch\n"


def test_a_python_without_torch_is_one_line_naming_it(tmp_path):
    """run_and_time.sh's $PYTHON on an interpreter without torch (scripts/test_torch.sh once leaked its own
    PYTHON, a bare python3.12, into the tests): its check says so in one line, not a metadata traceback. `-S`
    leaves site-packages, and so torch, off the path; the check itself needs only the checkout."""
    env = {**BASE, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-S", "-m", "bert.train.config", "--check-env"], env=env,
                         capture_output=True, text=True, cwd=tmp_path)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"error: torch is not installed for {sys.executable}: install it (README) or point " \
                         "$PYTHON at the interpreter that has it\n"


@pytest.mark.parametrize("precision,refused", [("fp32", True), ("bf16", False)])
def test_check_device_refuses_fp32_where_auto_picks_flash_varlen(monkeypatch, precision, refused):
    """On a GPU node `auto` is flash varlen, which takes half precision only: the default PRECISION=fp32 stops at the
    device check before anything is logged, not at the first forward after run_start. The GPU is simulated (the
    device check asks bert.dist.env.device_type which device the driver will pick)."""
    from bert.train import config as train_config

    monkeypatch.setattr("bert.dist.env.device_type", lambda want: "cuda")
    cfg = from_env_and_args([], {**BASE, "PRECISION": precision, "ATTENTION": "auto"})
    if refused:
        with pytest.raises(ValueError, match=r"ATTENTION=auto \(varlen on cuda\) needs PRECISION=bf16"):
            train_config.check_device(cfg)
    else:
        train_config.check_device(cfg)


def test_check_device_refuses_the_fused_residual_norm_on_a_gpu_without_triton(monkeypatch):
    """The same check as build_model's (bert.model.dropout_add_norm.check_residual_norm), before anything is logged;
    the GPU is simulated as above, and Triton taken away."""
    from bert.model import dropout_add_norm
    from bert.train import config as train_config

    monkeypatch.setattr("bert.dist.env.device_type", lambda want: "cuda")
    monkeypatch.setattr(dropout_add_norm, "triton", None)
    cfg = from_env_and_args([], {**BASE, "PRECISION": "bf16", "RESIDUAL_NORM": "fused"})
    with pytest.raises(ValueError, match="RESIDUAL_NORM=fused needs Triton"):
        train_config.check_device(cfg)
    train_config.check_device(from_env_and_args([], {**BASE, "PRECISION": "bf16"}))


def test_check_device_refuses_a_head_dimension_the_triton_attention_lacks(monkeypatch, tmp_path):
    """ATTENTION=triton's kernels take head dimensions of 16 to 128 in powers of two: a model of another width stops at
    the device check (the GPU simulated, Triton present), not at its first forward inside the warm-up."""
    from bert.model import triton_attention
    from bert.train import config as train_config

    monkeypatch.setattr("bert.dist.env.device_type", lambda want: "cuda")
    monkeypatch.setattr(triton_attention, "triton", object())
    odd = tmp_path / "bert_config.json"
    odd.write_text(json.dumps({"vocab_size": 30528, "hidden_size": 96, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "intermediate_size": 384}))
    env = {**BASE, "PRECISION": "bf16", "ATTENTION": "triton"}
    train_config.check_device(from_env_and_args([], env))  # tiny: 128 / 2 heads = 64
    with pytest.raises(ValueError, match=r"ATTENTION=triton on CUDA takes a head dimension .* not 48"):
        train_config.check_device(from_env_and_args([], {**env, "BERT_CONFIG": str(odd)}))
    train_config.check_device(from_env_and_args([], {**env, "BERT_CONFIG": str(odd), "ATTENTION": "varlen"}))
