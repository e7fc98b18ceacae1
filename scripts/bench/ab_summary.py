"""Summarise `ab_commits.sh`'s rounds: per method, the median tok/s of each side and their ratio, and whether
every prompt's tokens were the same on both sides in every round.

    python scripts/bench/ab_summary.py OUT [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarise(out: Path) -> dict:
    speeds: dict[str, dict[str, list[float]]] = {}
    outputs: dict[tuple[str, int], set[tuple[int, ...]]] = {}
    for results in sorted(out.glob("*/results.json")):
        side = results.parent.name.split("-")[0]
        for run in json.loads(results.read_text())["runs"]:
            outputs.setdefault((run["method"], run["prompt_index"]), set()).add(tuple(run["token_ids"]))
        for row in summary_rows(results):
            speeds.setdefault(row[0], {}).setdefault(side, []).append(row[1])
    methods = {}
    for method, sides in speeds.items():
        before, after = statistics.median(sides["before"]), statistics.median(sides["after"])
        methods[method] = {"before": sides["before"], "after": sides["after"], "median_before": before,
                           "median_after": after, "ratio": after / before}
    return {"methods": methods, "identical_tokens": all(len(v) == 1 for v in outputs.values())}


def summary_rows(results: Path) -> list[tuple[str, float]]:
    """(method, tok/s) of one bench: total tokens over total time per method, greedy runs."""
    totals: dict[str, list[float]] = {}
    for run in json.loads(results.read_text())["runs"]:
        if run["temperature"] == 0:
            t = totals.setdefault(run["method"], [0.0, 0.0])
            t[0] += run["new_tokens"]
            t[1] += run["seconds"]
    return [(m, n / s) for m, (n, s) in totals.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    s = summarise(args.out)
    for method, m in s["methods"].items():
        rounds = ", ".join(f"{b:.1f}/{a:.1f}" for b, a in zip(m["before"], m["after"]))
        print(f"{method}: before {m['median_before']:.1f} tok/s, after {m['median_after']:.1f} "
              f"(ratio {m['ratio']:.3f}); rounds before/after: {rounds}")
    print("tokens identical on both sides in every round:", s["identical_tokens"])
    if args.json:
        args.json.write_text(json.dumps(s, indent=1) + "\n")


if __name__ == "__main__":
    main()
