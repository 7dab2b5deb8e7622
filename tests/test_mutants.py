"""scripts/mutants.json stays in step with the code: every mutant still applies (its `old` text is in its file
exactly once, and `new` differs) and names test files that exist. Running the mutants themselves takes minutes
(`scripts/mutants.py`); this only keeps the list from going stale silently, and every edit valid Python."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_applies_and_names_existing_tests():
    mutants = json.loads((ROOT / "scripts" / "mutants.json").read_text())
    ids = [m["id"] for m in mutants]
    assert len(ids) == len(set(ids)), "duplicate mutant ids"
    for m in mutants:
        source = (ROOT / m["file"]).read_text()
        assert source.count(m["old"]) == 1, f"{m['id']}: its old text is in {m['file']} {source.count(m['old'])} times"
        assert m["new"] != m["old"], m["id"]
        if m["file"].endswith(".py"):  # a mutant that does not even compile would be "caught" by any test
            compile(source.replace(m["old"], m["new"]), m["file"], "exec")
        files = [t.split("::")[0] for t in m["tests"] if t.startswith("tests/")]
        assert files and all((ROOT / f).is_file() for f in files), m["id"]
