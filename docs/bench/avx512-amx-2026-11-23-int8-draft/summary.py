"""Speedups as total tokens over total time against `ar`, per bench folder and temperature (AMX Xeon, 2026-11-23).

    python docs/bench/avx512-amx-2026-11-23-int8-draft/summary.py
"""
import json
from pathlib import Path

for folder in sorted(Path(__file__).parent.iterdir()):
    if not (folder / "results.json").exists():
        continue
    runs = json.loads((folder / "results.json").read_text())["runs"]
    for temperature in sorted({r.get("temperature", 0) for r in runs}):
        totals: dict[str, list[float]] = {}
        for r in runs:
            if r.get("temperature", 0) == temperature:
                t = totals.setdefault(r["method"], [0, 0.0])
                t[0] += r["new_tokens"]
                t[1] += r["seconds"]
        ar = totals["ar"][0] / totals["ar"][1]
        parts = [f"{m} {n / s / ar:.2f}x" for m, (n, s) in totals.items() if m != "ar"]
        print(f"{folder.name:22s} T={temperature:g}: ar {ar:.1f} tok/s; " + "; ".join(parts))
