"""Can the tests fail? Each mutant in scripts/mutants.json is one small wrong edit to the code (a limit checked on
one side only, an off-by-one, a step left out) and the tests that must catch it. This runs each mutant's tests on
a copy of the repository with that edit made, and lists the mutants no test caught ("survived"): a test that
cannot fail is a defect, and a survivor points at one.

    .venv/bin/python scripts/mutants.py                 # all of them (the first 94 took 13 min on 2 cores)
    .venv/bin/python scripts/mutants.py --only clip-factor-clamp lamb-eps-inside

The working tree is never edited: the tracked files are copied to a temporary directory once. Exit status 1 if
a mutant survived or no longer applies (its `old` text is not in its file exactly once: tests/test_mutants.py
checks that on every test run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "scripts" / "mutants.json"


def load(only: list[str] | None = None, path: Path = MUTANTS) -> list[dict]:
    mutants = json.loads(path.read_text())
    if only:
        unknown = set(only) - {m["id"] for m in mutants}
        if unknown:
            raise SystemExit(f"no mutant named {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m["id"] in only]
    return mutants


def copy_tracked(dst: Path) -> None:
    """The tracked files as they are in the working tree, committed in a repository of their own (some tools,
    logging/make_submission.py among them, record the commit they run from)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name, follow_symlinks=False)  # a link stays one (config_DGXA100_128x8.sh)
    git = ["git", "-c", "user.name=mutants", "-c", "user.email=mutants@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the working tree, for mutants"]):
        subprocess.run([*git, *command], cwd=dst, check=True, capture_output=True)
    if (ROOT / ".venv").is_dir():  # run_and_time.sh, which some tests start, takes python from the repository's .venv
        (dst / ".venv").symlink_to(ROOT / ".venv")  # untracked and ignored there, as here
        with (dst / ".git" / "info" / "exclude").open("a") as exclude:
            exclude.write("/.venv\n")


def passes(tree: Path, tests: list[str], timeout: int) -> bool | None:
    """Whether `tests` pass in `tree` (None: they ran past `timeout`)."""
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=tree, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return None


def run_one(tree: Path, mutant: dict, timeout: int) -> tuple[str, float]:
    path = tree / mutant["file"]
    original = path.read_text()
    if original.count(mutant["old"]) != 1:
        return "stale", 0.0
    path.write_text(original.replace(mutant["old"], mutant["new"]))
    start = time.perf_counter()
    try:
        result = {True: "SURVIVED", False: "killed", None: "timeout"}[passes(tree, mutant["tests"], timeout)]
    finally:
        path.write_text(original)
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutant's tests")
    parser.add_argument("--list", type=Path, default=MUTANTS, help="the mutants' JSON (a draft list, for one)")
    args = parser.parse_args(argv)
    mutants = load(args.only, args.list)
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tree = Path(tmp)
        copy_tracked(tree)
        # Unmutated first: a selection that fails on the copy as it is would count every mutant as killed.
        selections = {tuple(m["tests"]) for m in mutants}
        broken = [" ".join(t) for t in sorted(selections) if not passes(tree, list(t), args.timeout)]
        if broken:
            print("these tests fail without a mutant, so they can kill none:\n  " + "\n  ".join(broken))
            return 1
        print(f"{'mutant':<28} {'file':<32} {'result':<9} {'s':>5}")
        bad = []
        for m in mutants:
            result, seconds = run_one(tree, m, args.timeout)
            print(f"{m['id']:<28} {m['file']:<32} {result:<9} {seconds:5.0f}", flush=True)
            if result != "killed":
                bad.append(m["id"])
    print(f"{len(mutants) - len(bad)} of {len(mutants)} killed" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
