"""README.md's headline table is the one scripts/readme_table.py generates from docs/bench (no hand-edited figures)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_headline_table_matches_the_measured_files() -> None:
    script = _script()
    readme = (ROOT / "README.md").read_text()
    assert script.replace_block(readme, script.table()) == readme, "run: python scripts/readme_table.py --write"


def test_every_headline_row_names_a_date_a_commit_and_an_existing_results_file() -> None:
    import json

    rows = json.loads((ROOT / "docs" / "bench" / "headline.json").read_text())["rows"]
    assert rows
    for row in rows:
        assert (ROOT / row["results"]).is_file(), row["results"]
        assert len(row["date"]) == 10 and row["commit"], row
