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
    assert script.replace_block(readme, script.readme_table()) == readme, "run: python scripts/readme_table.py --write"


def test_readme_headline_table_has_at_most_8_rows_one_per_machine_kind_and_model() -> None:
    body = [line for line in _script().readme_table().splitlines()[2:] if line.startswith("|")]
    assert 0 < len(body) <= 8, len(body)
    keys = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in body]
    assert len(set(keys)) == len(keys), keys


def test_benchmarks_history_table_of_every_headline_run_matches_the_measured_files() -> None:
    script = _script()
    text = (ROOT / "docs" / "benchmarks-history.md").read_text()
    assert script.replace_block(text, script.table()) == text, \
        "run: python scripts/readme_table.py --write"


def test_readme_shows_the_newest_run_of_each_machine_kind_and_model_only() -> None:
    rows = [{"machine": "AMD EPYC (Zen 4), AVX-512 VNNI + BF16 (no AMX)", "model": "SmolLM2-135M Q4_1", "date": "2"},
            {"machine": "AMD EPYC, AVX-512 BF16 (no AMX)", "model": "SmolLM2-135M, bf16", "date": "1"},
            {"machine": "AMD EPYC (Zen 4), AVX-512 VNNI", "model": "Qwen2.5-Coder-1.5B Q4_K_M", "date": "2"},
            {"machine": "Intel Xeon, AVX-512 BF16 + AMX", "model": "SmolLM2-135M Q4_1", "date": "1"},
            {"machine": "AMD EPYC (Zen 3), AVX2 (no AVX-512)", "model": "SmolLM2-135M Q4_1", "date": "0"}]
    script = _script()
    kept = script.newest_per_machine_and_model(rows)
    assert [(script.machine_kind(r["machine"]), r["model"], r["date"]) for r in kept] == [
        ("AMD EPYC, AVX-512", "SmolLM2-135M Q4_1", "2"), ("AMD EPYC, AVX-512", "Qwen2.5-Coder-1.5B Q4_K_M", "2"),
        ("Intel Xeon, AMX", "SmolLM2-135M Q4_1", "1"), ("AMD EPYC, AVX2 only", "SmolLM2-135M Q4_1", "0")]


def test_every_headline_row_names_a_date_a_commit_and_an_existing_results_file() -> None:
    import json

    rows = json.loads((ROOT / "docs" / "bench" / "headline.json").read_text())["rows"]
    assert rows
    for row in rows:
        assert (ROOT / row["results"]).is_file(), row["results"]
        assert len(row["date"]) == 10 and row["commit"], row
