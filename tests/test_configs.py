"""Shell configs against the published recipes, the training rules and the driver's own validation.

References: NVIDIA's published configs [NVIDIA-BERT], Samsung's [Samsung-BERT], the RCP table
(`rcps_bert.json` in [MLPerf-logging]), the eval formula [MLPerf-BERT-ref], and
`python -m bert.train.config --check-env` (the driver's parser).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert.balance import STRATEGIES
from bert.model.attention import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in ROOT.glob("config_*.sh") if not p.name.endswith("_common.sh") and not p.is_symlink())
CLEAN_ENV = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}

# Published values, transcribed from the reference (file it came from in the comment).
PUBLISHED = {
    # NV20 config_DGXA100_1x8x56x1.sh
    "DGXA100_1x8x56x1": dict(GBS=448, LR=0.000425, MAX_STEPS=6700, OPT_LAMB_BETA_1=0.9, OPT_LAMB_BETA_2=0.999,
                             WEIGHT_DECAY_RATE=0.01, WARMUP_STEPS=0, START_WARMUP_STEP=0, OPTIMIZER="lamb"),
    # R21 pytorch-22.09/config_DGXA100_8x8x48x1.sh
    "DGXA100_8x8x48x1": dict(GBS=3072, LR=0.0020992, MAX_STEPS=1059, OPT_LAMB_BETA_1=0.60466,
                             OPT_LAMB_BETA_2=0.85437, WEIGHT_DECAY_RATE=0.1, WARMUP_STEPS=0, START_WARMUP_STEP=0,
                             OPTIMIZER="lamb"),
    # R30 config_DGXH100_8x8x72x1.sh: NVIDIA's GBS-4608 recipe
    "DGXA100_16x8x36x1": dict(GBS=4608, LR=0.00258, MAX_STEPS=700, OPT_LAMB_BETA_1=0.6, OPT_LAMB_BETA_2=0.7,
                              WEIGHT_DECAY_RATE=0.1, WARMUP_STEPS=200330, START_WARMUP_STEP=-200000, OPTIMIZER="lamb"),
    # Samsung config_Samsung_Supercomputer21_DGXA100_128x8x16x1.sh
    "DGXA100_128x8x16x1": dict(GBS=16384, LR=0.00039299421615882676, MAX_STEPS=299, OPT_LAMB_BETA_1=0.8003575444254268,
                               OPT_LAMB_BETA_2=0.8174653681457493, WEIGHT_DECAY_RATE=0.0028861703130042965,
                               WARMUP_STEPS=82, START_WARMUP_STEP=-16, OPTIMIZER="adam", EPSILON=1e-9,
                               END_LR=0.0000494549100544884, LR_MAX_STEPS=179, GRAD_CLIP="bucket", BALANCE="samsung",
                               EVAL_ITER_SAMPLES=325000, MAX_SAMPLES_TERMINATION=5e6),
    # NV31 config_DGXH100_1x8x48x1_pack.sh, unpacked (2 sequences per packed sample)
    "DGXH100_1x8x96x1": dict(GBS=768, LR=0.00096, MAX_STEPS=3680, OPT_LAMB_BETA_1=0.60466, OPT_LAMB_BETA_2=0.85437,
                             WEIGHT_DECAY_RATE=0.1, WARMUP_STEPS=0, START_WARMUP_STEP=0, OPTIMIZER="lamb"),
    # R30 config_DGXH100_8x8x72x1.sh
    "DGXH100_8x8x72x1": dict(GBS=4608, LR=0.00258, MAX_STEPS=700, OPT_LAMB_BETA_1=0.6, OPT_LAMB_BETA_2=0.7,
                             WEIGHT_DECAY_RATE=0.1, WARMUP_STEPS=200330, START_WARMUP_STEP=-200000, OPTIMIZER="lamb"),
}


EXPORT_OR_COMMON = r'export [A-Z_0-9]+=|source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/config_\w+_common\.sh"$'


def sourced(config: Path, **overrides: str) -> dict[str, str]:
    """The environment after `source config` in an otherwise empty shell."""
    out = subprocess.run(["bash", "-c", f'source "{config}" && env -0'], env={**CLEAN_ENV, **overrides},
                         capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)


def rules_eval_interval(gbs: int) -> int:
    return math.floor(0.05 * (230.23 * gbs + 3_000_000) / 25_000) * 25_000


def test_every_issue_system_has_a_config():
    names = {p.name for p in CONFIGS}
    assert {f"config_{s}.sh" for s in PUBLISHED} | {"config_CPU_1x2.sh"} == names


def test_design_card_name_is_samsungs_128_node_recipe():
    """The design card's `config_DGXA100_128x8.sh` is the 128x8x16x1 config (a link, so they cannot drift)."""
    short = ROOT / "config_DGXA100_128x8.sh"
    assert short.resolve() == (ROOT / "config_DGXA100_128x8x16x1.sh").resolve()
    env = sourced(short)
    assert (env["OPTIMIZER"], env["GRAD_CLIP"], env["BALANCE"]) == ("adam", "bucket", "samsung")
    assert (env["DGXNNODES"], env["DGXNGPU"]) == ("128", "8")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_only_exports(config):
    for line in config.read_text().splitlines():
        code = line.split("#", 1)[0].strip()
        assert not code or re.match(EXPORT_OR_COMMON, code), f"{config.name}: {line!r} is not an export"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_passes_the_drivers_validation(config):
    env = sourced(config)
    check = subprocess.run(["python", "-m", "bert.train.config", "--check-env"], env=env, capture_output=True,
                           text=True, cwd=ROOT)
    assert check.returncode == 0, check.stderr
    assert env["BALANCE"] in STRATEGIES
    assert env["ATTENTION"] in {"auto", *BACKENDS}


@pytest.mark.parametrize("system", PUBLISHED)
def test_config_matches_published_recipe_and_rules(system):
    env = sourced(ROOT / f"config_{system}.sh")
    nodes, gpus, bs, ga = map(int, re.search(r"_(\d+)x(\d+)x(\d+)x(\d+)$", system).groups())
    assert (env["DGXSYSTEM"], int(env["DGXNNODES"]), int(env["DGXNGPU"])) == (system, nodes, gpus)
    assert (int(env["BATCHSIZE"]), int(env["GRADIENT_STEPS"])) == (bs, ga)
    published = dict(PUBLISHED[system])
    gbs = published.pop("GBS")
    assert nodes * gpus * bs * ga == gbs
    for name, value in published.items():
        assert (float(env[name]) if isinstance(value, (int, float)) else env[name]) == value, name
    assert env["MLPERF_DIVISION"] == "closed" and float(env["TARGET_MLM_ACCURACY"]) == 0.720
    assert int(env["EVAL_ITER_SAMPLES"]) == int(env["EVAL_ITER_START_SAMPLES"]) == rules_eval_interval(gbs)
    assert int(env["NUM_EVAL_EXAMPLES"]) == 10000


@pytest.mark.parametrize("system", ["DGXA100_128x8x16x1", "DGXH100_8x8x72x1"])
def test_multinode_configs_state_their_gradient_reduction(system):
    """The Samsung config and one H100 config choose the 2-D reduction and the dtype buckets travel in."""
    env = sourced(ROOT / f"config_{system}.sh")
    assert env["GRAD_REDUCE"] == "hierarchical" and env["GRAD_COMM_DTYPE"] in ("fp16", "bf16")
    assert (env["GRAD_COMM_DTYPE"] == "fp16") == (env["PRECISION"] == "fp16")  # fp16 only under loss scaling


@pytest.mark.parametrize("system", PUBLISHED)
def test_dgx_configs_hold_master_weights_in_the_optimizer(system):
    """As the submissions: an fp16 model on the A100 (NVIDIA's --fp16 --distributed_lamb), bf16 on the H100."""
    env = sourced(ROOT / f"config_{system}.sh")
    assert (env["MASTER_WEIGHTS"], env["PRECISION"]) == ("1", "fp16" if system.startswith("DGXA100") else "bf16")


@pytest.mark.parametrize("system", PUBLISHED)
def test_dgx_configs_refuse_to_train_without_a_gpu(system):
    """DEVICE=cuda: a task that sees no GPU stops in one line (tests/test_config.py) instead of training on the CPU."""
    assert sourced(ROOT / f"config_{system}.sh")["DEVICE"] == "cuda"
    assert "DEVICE" not in sourced(ROOT / "config_CPU_1x2.sh")  # auto: the CPU default runs anywhere


def test_walltime_scales_with_nexp():
    one = sourced(ROOT / "config_DGXA100_1x8x56x1.sh", NEXP="1")["WALLTIME"]
    ten = sourced(ROOT / "config_DGXA100_1x8x56x1.sh", NEXP="10")["WALLTIME"]
    assert (int(one), int(ten)) == (75 + 5, 750 + 5)


def test_cpu_default_is_two_processes_open_division():
    env = sourced(ROOT / "config_CPU_1x2.sh")
    assert (env["DGXNNODES"], env["DGXNGPU"], env["MLPERF_DIVISION"]) == ("1", "2", "open")
    assert env["DATADIR_PHASE2"].startswith(env["BERT_DATA"])


def run_and_time(config: Path, unset: tuple[str, ...] = (), **overrides: str) -> subprocess.CompletedProcess:
    unsets = "".join(f"unset {name}; " for name in unset)
    from test_harness import TINY_FROM_SCRATCH

    exports = "".join(f"export {k}='{v}'; " for k, v in {**TINY_FROM_SCRATCH, **overrides}.items())
    return subprocess.run(["bash", "-c", f'source "{config}"; {unsets}{exports}exec "{ROOT}/run_and_time.sh"'],
                          env=CLEAN_ENV, capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("unset, overrides, culprit", [
    (("LR",), {}, "$LR"),
    ((), {"LR": "fast"}, "$LR"),
    ((), {"MAX_STEPS": "12.5"}, "$MAX_STEPS"),
    ((), {"OPTIMIZER": "sgd"}, "$OPTIMIZER"),
    (("DATADIR_PHASE2",), {}, "$DATADIR_PHASE2"),
    (("DGXNGPU",), {}, "$DGXNGPU"),
    ((), {"DGXNNODES": "two"}, "$DGXNNODES"),
    ((), {"BALANCE": "samsnug"}, "$BALANCE"),
    ((), {"BATCHSIZE": "inf"}, "$BATCHSIZE"),
    ((), {"GRAD_REDUCE": "hierarchical", "GRAD_REDUCE_NODE_SIZE": "3"}, "$GRAD_REDUCE_NODE_SIZE"),
], ids=["missing-LR", "malformed-LR", "fractional-MAX_STEPS", "unknown-OPTIMIZER", "missing-DATADIR", "missing-DGXNGPU",
        "malformed-DGXNNODES", "misspelled-BALANCE", "infinite-BATCHSIZE", "node-size-not-dividing-world"])
def test_bad_config_fails_before_training_naming_the_variable(unset, overrides, culprit):
    out = run_and_time(ROOT / "config_CPU_1x2.sh", unset, **overrides)
    assert out.returncode == 2
    assert culprit in out.stderr and out.stderr.count("\n") == 1, out.stderr  # one line, then exit 2
    assert "STARTING TIMING RUN" not in out.stdout


@pytest.mark.parametrize("system", [s for s in PUBLISHED if s.startswith("DGXH100")])
@pytest.mark.parametrize("compile_mode", [None, "off", "debug"])
def test_h100_configs_compile_the_update_with_the_model_or_neither(system, compile_mode):
    """The fastest measured step compiles both (800 samples/s on an H200); COMPILE=off alone must still parse,
    which it did not while COMPILE_OPTIMIZER=1 stayed: the optimizer has no mode to be compiled with then."""
    env = sourced(ROOT / f"config_{system}.sh", **({} if compile_mode is None else {"COMPILE": compile_mode}))
    assert (env["COMPILE"], env["COMPILE_OPTIMIZER"]) == {None: ("default", "1"), "off": ("off", "0")}.get(
        compile_mode, (compile_mode, "1"))
    out = subprocess.run([sys.executable, "-m", "bert.train.config", "--check-env"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
