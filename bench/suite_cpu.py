"""Where the test suite's CPU time goes: each test file's and each test's CPU seconds, in the pytest worker and in
the subprocesses the test waited for (driver runs, bench scripts, checkers).

On the 2-core VM the suite is CPU-bound (four workers share two cores), so a test's wall time is mostly other
workers' time; its CPU seconds are what cutting it would save. tests/conftest.py records them when SUITE_CPU_DIR
is set; this runs the suite that way (or reads a folder of an earlier run) and prints the files and tests that cost
most, in CPU-minutes.

    python3 bench/suite_cpu.py --run      # the README's test command (it installs .venv); results/bench/suite_cpu.json
    .venv/bin/python bench/suite_cpu.py --dir DIR --top 20   # a folder an earlier run wrote
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read(folder: Path) -> list[tuple[str, float, float]]:
    """(test id, own CPU s, children's CPU s) for every line the workers wrote."""
    rows = []
    for path in sorted(folder.glob("*.tsv")):
        for line in path.read_text().splitlines():
            test, own, children = line.split("\t")[:3]
            rows.append((test, float(own), float(children)))
    if not rows:
        raise SystemExit(f"suite_cpu: no test times under {folder} (run the suite with SUITE_CPU_DIR={folder})")
    return rows


def per_file(rows: list[tuple[str, float, float]]) -> list[dict]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for test, own, children in rows:
        f = files[test.split("::")[0]]
        f[0], f[1], f[2] = f[0] + own, f[1] + children, f[2] + 1
    return sorted(({"file": name, "own_s": round(own, 1), "children_s": round(children, 1), "tests": n}
                   for name, (own, children, n) in files.items()), key=lambda r: -(r["own_s"] + r["children_s"]))


def summary(rows: list[tuple[str, float, float]], wall_s: float | None) -> dict:
    own, children = sum(r[1] for r in rows), sum(r[2] for r in rows)
    tests = sorted(({"test": t, "own_s": o, "children_s": c} for t, o, c in rows),
                   key=lambda r: -(r["own_s"] + r["children_s"]))
    return {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
            "tests": len(rows), "own_cpu_min": round(own / 60, 1), "children_cpu_min": round(children / 60, 1),
            "cpu_min": round((own + children) / 60, 1), "wall_min": None if wall_s is None else round(wall_s / 60, 1),
            "files": per_file(rows), "slowest_tests": tests[:40]}


def table(result: dict, top: int) -> str:
    wall = "" if result["wall_min"] is None else f", wall {result['wall_min']} min"
    lines = [f"{result['tests']} tests: {result['cpu_min']} CPU-min ({result['own_cpu_min']} in the workers, "
             f"{result['children_cpu_min']} in their subprocesses){wall}", "",
             f"{'CPU s':>7} {'own':>7} {'subproc':>7} {'tests':>5}  file"]
    for f in result["files"][:top]:
        lines.append(f"{f['own_s'] + f['children_s']:7.1f} {f['own_s']:7.1f} {f['children_s']:7.1f} {f['tests']:5d}  "
                     f"{f['file']}")
    lines += ["", f"{'CPU s':>7} {'own':>7} {'subproc':>7}  test"]
    for t in result["slowest_tests"][:top]:
        lines.append(f"{t['own_s'] + t['children_s']:7.1f} {t['own_s']:7.1f} {t['children_s']:7.1f}  {t['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run scripts/test.sh (its exit status is kept) and time it")
    ap.add_argument("--dir", type=Path, help="the folder of per-worker times (default: a new temporary one)")
    ap.add_argument("--top", type=int, default=15, help="files and tests to print")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "bench" / "suite_cpu.json")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to scripts/test.sh")
    args = ap.parse_args(argv)
    if not args.run and args.dir is None:
        ap.error("give --run, or --dir with an earlier run's times")
    folder = args.dir or Path(tempfile.mkdtemp(prefix="suite_cpu."))
    status, wall = 0, None
    if args.run:
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.glob("*.tsv")):
            ap.error(f"{folder} already holds times: a run would add to them")
        start = time.perf_counter()
        status = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args.pytest_args], cwd=ROOT,
                                env={**os.environ, "SUITE_CPU_DIR": str(folder)}).returncode
        wall = time.perf_counter() - start
    result = {**summary(read(folder), wall), "pytest_status": status if args.run else None}
    print(table(result, args.top))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
