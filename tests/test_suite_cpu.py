"""bench/suite_cpu.py: the per-worker files tests/conftest.py writes, summed per file and per test, and the hook
itself in a real pytest run (its CPU seconds against the test's own getrusage)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_times_are_summed_per_file_and_sorted_by_cost(tmp_path, capsys):
    bench = load_script("bench/suite_cpu.py")
    (tmp_path / "worker-1.tsv").write_text("tests/test_a.py::one\t1.50\t0.00\ntests/test_b.py::two\t0.25\t9.00\n")
    (tmp_path / "worker-2.tsv").write_text("tests/test_a.py::three[x]\t2.00\t0.50\n")
    out = tmp_path / "cpu.json"
    assert bench.main(["--dir", str(tmp_path), "--top", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["files"] == [{"file": "tests/test_b.py", "own_s": 0.2, "children_s": 9.0, "tests": 1},
                               {"file": "tests/test_a.py", "own_s": 3.5, "children_s": 0.5, "tests": 2}]
    assert [t["test"] for t in result["slowest_tests"]] == ["tests/test_b.py::two", "tests/test_a.py::three[x]",
                                                          "tests/test_a.py::one"]
    assert (result["tests"], result["cpu_min"], result["wall_min"]) == (3, round(13.25 / 60, 1), None)
    table = capsys.readouterr().out
    assert "3 tests:" in table and "tests/test_a.py::one" not in table  # --top 2


def test_an_empty_folder_is_an_error_naming_it(tmp_path):
    bench = load_script("bench/suite_cpu.py")
    with pytest.raises(SystemExit, match=f"no test times under {tmp_path}"):
        bench.main(["--dir", str(tmp_path), "--json", str(tmp_path / "x.json")])


def test_the_hook_records_a_subprocess_a_test_waited_for(tmp_path):
    """A test that burns about 0.3 CPU-s in a child: the hook charges it to the test's subprocesses, not its own."""
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "def test_burn():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'], check=True)\n")
    times = tmp_path / "times"
    times.mkdir()
    # the repository's conftest, as the suite loads it
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "SUITE_CPU_DIR": str(times)})
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = [line for f in times.glob("*.tsv") for line in f.read_text().splitlines()]
    test, own, children = line.split("\t")
    assert test.endswith("test_burn.py::test_burn") and float(children) >= 0.3 and float(own) < 0.3
