"""bench/plan_memory.py on a small epoch: one row per strategy, int32 ids, and the JSON it prints from."""

from __future__ import annotations

import json

from script_modules import load_script


def test_plan_memory_reports_each_strategy(tmp_path, capsys):
    bench = load_script("bench/plan_memory.py")
    out = tmp_path / "plan_memory.json"
    assert bench.main(["--samples", "40000", "--world", "8", "--per-node", "4", "--strategies", "none", "samsung",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["strategy"] for r in report["rows"]] == ["none", "samsung"]
    assert all(r["id_dtype"] == "int32" and r["numpy_peak_gb"] >= r["kept_gb"] >= 0 for r in report["rows"])
    assert report["length_index_gb"] == round(40000 * 4 / 1e9, 2) and "samsung" in capsys.readouterr().out
