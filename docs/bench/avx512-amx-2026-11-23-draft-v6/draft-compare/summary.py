"""Speedups as total tokens over total time against `ar`, per bench folder here (AMX Xeon, 2026-11-23).

    python docs/bench/avx512-amx-2026-11-23-draft-v6/draft-compare/summary.py
"""
import json
from pathlib import Path

for folder in sorted(Path(__file__).parent.iterdir()):
    if not (folder / "results.json").exists():
        continue
    runs = json.loads((folder / "results.json").read_text())["runs"]
    rate = {}
    for method in ("ar", "staged", "tree"):
        rows = [r for r in runs if r["method"] == method]
        rate[method] = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    print(f"{folder.name:22s} staged {rate['staged'] / rate['ar']:.2f}x  tree {rate['tree'] / rate['ar']:.2f}x")
