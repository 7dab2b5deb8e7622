"""Assemble an MLPerf Training submission folder for BERT and check it with the official tools (5.0.0).

    python logging/make_submission.py results/DGXA100_1x8x56x1/bert/result_*.txt \\
        --org MyOrg --system dgxa100_pytorch --out submission [--rcp-bypass]

First every log goes through verify_result.py's checks (its `--target`, `--eval-samples`, `--eval-start`,
`--eval-every`): a run continued from a checkpoint, or one whose status disagrees with its accuracy, passes the
official checkers but is not a result, and is refused here before anything is built. Then it builds, under
OUT/<org>/ (which must not exist yet):

    systems/<system>.json                         every field the system-description checker requires
    results/<system>/bert/result_<k>.txt          the given logs, renumbered 0..n-1
    benchmarks/bert/implementations/<impl>/       this repository's tracked files (`git ls-files`)

then runs `package_checker`, `rcp_checker` and `result_summarizer` on a throw-away copy (they write
scaling.json into the tree and *_checker.log into the working directory) and prints their verdicts and
the score: the olympic mean of the runs' times to train, in minutes. `--rcp-bypass` is for data with no
reference convergence point (synthetic): the RCP verdict is still printed, labelled as bypassed.
A failed check prints the checker's own reason (its ERROR lines). Exits 0 only if every check passed
(the RCP check: or was bypassed with --rcp-bypass), else 1, naming the failed checks on stderr.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from result_log import read_events, values
from verify_result import Expect, add_expect_args, expect_from, problems_of

RULESET = "5.0.0"
ROOT = Path(__file__).resolve().parents[1]
STATUSES = ("Available on-premise", "Available cloud", "Research, Development, or Internal (RDI)", "Preview")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _sockets() -> str:
    ids = {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("physical id")} if Path("/proc/cpuinfo").exists() else set()
    return str(len(ids) or 1)


def _memory() -> str:
    kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    return f"{kib // 2**20} GB"


def _os_name() -> str:
    release = Path("/etc/os-release")
    pretty = [line for line in release.read_text().splitlines() if line.startswith("PRETTY_NAME=")] \
        if release.exists() else []
    return pretty[0].split("=", 1)[1].strip('"') if pretty else platform.platform()


# Read from the machine that runs this script, which need not be the system that produced the logs.
HOST_FIELDS = ("host_processors_per_node", "host_processor_model_name", "host_processor_core_count",
               "host_processor_vcpu_count", "host_memory_capacity", "framework", "other_software_stack",
               "operating_system")


def _torch_version() -> str:
    """torch.__version__ as its package metadata has it: importing torch for a string costs 2 s of CPU."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def describe_system(args: argparse.Namespace, division: str) -> dict[str, str]:
    """The 33 fields the 5.0.0 system-description checker requires, filled from this host where it can
    (`HOST_FIELDS`)."""
    cores = str(os.cpu_count() or "")
    desc = {field: "" for field in (
        "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_storage_type",
        "host_storage_capacity", "host_networking", "host_networking_topology", "host_memory_configuration",
        "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
        "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
        "accelerator_interconnect_topology", "cooling", "hw_notes", "sw_notes")}
    desc.update({
        "submitter": args.org, "division": division, "status": args.status, "system_name": args.system,
        "number_of_nodes": str(args.nodes), "host_processors_per_node": _sockets(),
        "host_processor_model_name": _cpu_model(),
        "host_processor_core_count": cores, "host_processor_vcpu_count": cores, "host_memory_capacity": _memory(),
        "accelerators_per_node": str(args.accelerators_per_node), "accelerator_model_name": args.accelerator,
        "framework": f"PyTorch {_torch_version()}", "other_software_stack": f"Python {platform.python_version()}",
        "operating_system": _os_name(),
    })
    return desc


def tracked_files(repo: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"make_submission: the implementation is copied from a git checkout; {repo}: {out.stderr}")
    return [Path(p) for p in out.stdout.split("\0") if p and not p.startswith("results/")]


def refuse_non_results(logs: list[Path], expect: Expect) -> None:
    """verify_result.py's checks on every log before anything is built: the official checkers let through a run
    continued from a checkpoint (it times only the continuation) and a run whose status disagrees with its
    accuracy, and copied in as result_<k>.txt its file name would no longer say so."""
    problems = [f"{log}: {problem}" for log in logs for problem in problems_of(log, expect)]
    if problems:
        raise SystemExit("\n".join(f"make_submission: {p}" for p in problems) + f"\nmake_submission: "
                         f"{len(problems)} problem(s) in the logs (python logging/verify_result.py checks them): "
                         "no submission folder made")


def build(args: argparse.Namespace) -> Path:
    org = args.out / args.org
    if org.exists():
        raise SystemExit(f"make_submission: {org} exists; choose another --out")
    refuse_non_results(args.logs, expect_from(args))
    divisions = {v for log in args.logs for v in values(read_events(log), "submission_division")}
    if len(divisions) != 1:
        raise SystemExit(f"make_submission: the logs disagree on or lack submission_division: {sorted(divisions)}")
    (org / "systems").mkdir(parents=True)
    system = describe_system(args, divisions.pop())
    given = json.loads(args.system_json.read_text()) if args.system_json else {}
    system.update(given)
    from_host = [field for field in HOST_FIELDS if field not in given]
    if from_host:
        print(f"make_submission: note: systems/{args.system}.json: {', '.join(from_host)} describe this machine "
              f"({platform.node()}), which may not be the system that ran the logs; give them in --system-json",
              file=sys.stderr)
    (org / "systems" / f"{args.system}.json").write_text(json.dumps(system, indent=2) + "\n")
    results = org / "results" / args.system / "bert"
    results.mkdir(parents=True)
    for k, log in enumerate(args.logs):
        shutil.copyfile(log, results / f"result_{k}.txt")
    impl = org / "benchmarks" / "bert" / "implementations" / args.impl
    for rel in tracked_files(ROOT):
        (impl / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, impl / rel)
    return org


def _run(argv: list[str], cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True)
    return out.stdout + out.stderr


def reasons(output: str) -> str:
    """A checker's own ERROR lines, joined: why it failed, without its INFO chatter."""
    errors = [line.split(" - ", 1)[1].strip() for line in output.splitlines() if line.startswith("ERROR - ")]
    if errors:
        return "; ".join(errors)
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def check(org: Path, system: str, rcp_bypass: bool) -> list[str]:
    """Official checkers on a copy of `org`; prints verdicts and the score; returns the checks that failed
    and were not bypassed (empty: a valid submission)."""
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / org.name
        shutil.copytree(org, copy)
        package = _run(["mlperf_logging.package_checker", str(copy), "training", RULESET,
                        *(["--rcp-bypass"] if rcp_bypass else []), "--log_output", f"{tmp}/package.log"], Path(tmp))
        package_ok = "PACKAGE CHECKER FOUND NO ERRORS" in package  # its exit code is 0 either way
        print(f"package_checker {RULESET}: " + ("PASS" if package_ok else f"FAIL: {reasons(package)}")
              + (" (RCP check bypassed: --rcp-bypass)" if rcp_bypass else ""))
        if not package_ok:
            failed.append("package_checker")

        rcp = _run(["mlperf_logging.rcp_checker", "--rcp_usage", "training", "--rcp_version", RULESET,
                    "--log_output", f"{tmp}/rcp.log", str(copy / "results" / system / "bert")], Path(tmp))
        rcp_ok = "RCP test PASSED" in rcp
        if rcp_ok:
            print(f"rcp_checker {RULESET}: PASS")
        elif rcp_bypass:
            print(f"rcp_checker {RULESET}: FAIL -- BYPASSED with --rcp-bypass (no reference convergence point for "
                  f"this data): {reasons(rcp)}")
        else:
            print(f"rcp_checker {RULESET}: FAIL: {reasons(rcp)}")
            failed.append("rcp_checker")

        summary = _run(["mlperf_logging.result_summarizer", str(copy), "training", RULESET,
                        "--csv", f"{tmp}/summary.csv"], Path(tmp))
        score = _score(Path(tmp) / "summary.csv")
        print(f"score (result_summarizer {RULESET}): " + (f"bert {score} minutes" if score else
                                                           f"none: {reasons(summary)}"))
        if score is None:
            failed.append("result_summarizer")
    return failed


def _score(summary_csv: Path) -> str | None:
    if not summary_csv.exists():
        return None
    with open(summary_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("bert") not in (None, ""):
                return row["bert"]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="result logs (10 for a valid BERT submission)")
    p.add_argument("--out", type=Path, required=True, help="folder to create <org>/ in")
    p.add_argument("--org", required=True, help="submitter name (folder and system JSON)")
    p.add_argument("--system", required=True, help="system name: systems/<system>.json, results/<system>/")
    p.add_argument("--impl", default="pytorch", help="implementation folder name")
    p.add_argument("--status", default=STATUSES[0], choices=STATUSES)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--accelerators-per-node", type=int, default=0)
    p.add_argument("--accelerator", default="", help="accelerator model name")
    p.add_argument("--system-json", type=Path, help="JSON object whose fields override the generated ones")
    p.add_argument("--rcp-bypass", action="store_true", help="pass --rcp-bypass to the package checker")
    add_expect_args(p)  # what verify_result.py checks the logs against
    args = p.parse_args(argv)
    org = build(args)
    print(f"submission folder: {org}")
    failed = check(org, args.system, args.rcp_bypass)
    if failed:
        print(f"make_submission: {' and '.join(failed)} failed: {org} is not a valid submission", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
