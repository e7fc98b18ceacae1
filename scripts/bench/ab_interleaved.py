"""Two commits' decoding speed on this machine, interleaved request by request: is a change speed-neutral?

Why: on the shared 2-core VMs two `stagedspec bench` runs minutes apart differ by 10-15%, so comparing two
commits' benches cannot show a 2% difference.  This keeps one worker process per commit alive, each with the
same models loaded from its own source tree, and alternates them request by request (the order swapped every
pass over the prompts), so each pair of measurements is seconds apart.  It prints, per method, the median over requests of
the after/before ratio of tokens a second, and checks that both commits emitted the same tokens.

    python scripts/bench/ab_interleaved.py BEFORE_TREE AFTER_TREE --methods ar,auto --prompts prose:4 \\
        --max-new-tokens 64 --repeats 10 [--oracle default] [--draft default] [--json FILE]

A tree is a checkout (`git worktree add --detach /tmp/ab-before COMMIT`).  Workers use only the library's
stable surface (`Pipeline.load`, `Pipeline.generate`, `bench.prompts.load_prompts`).  Each worker gets its own
`STAGEDSPEC_CACHE`, so neither reads what the other learned.  Nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
from stagedspec.bench.prompts import load_prompts
from stagedspec.pipeline import Pipeline, SpeculationConfig
cfg = json.loads(sys.argv[1])
prompts = []
for part in cfg["prompts"].split(","):
    kind, n = part.split(":")
    prompts += load_prompts(kind, int(n))
pipes = {m: Pipeline.load(cfg["oracle"], None if m == "ar" else cfg["draft"], quant="auto",
                          speculation=SpeculationConfig(method=m)) for m in cfg["methods"]}
print(json.dumps({"ready": len(prompts)}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    t0 = time.perf_counter()
    res = pipes[job["method"]].generate(prompts[job["prompt"]], chat=True, max_new_tokens=cfg["max_new_tokens"])
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": list(res.token_ids), "seconds": dt}), flush=True)
"""


class Worker:
    """One commit's process: loads the pipelines once, then generates one request per line it is sent."""

    def __init__(self, tree: Path, cfg: dict, cache: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), STAGEDSPEC_CACHE=str(cache))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg)], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.n_prompts = json.loads(self._line())["ready"]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited (code {self.proc.wait()})")
        return line

    def run(self, method: str, prompt: int) -> dict:
        self.proc.stdin.write(json.dumps({"method": method, "prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--oracle", default="default")
    ap.add_argument("--draft", default="default", help="the draft of every method but ar")
    ap.add_argument("--methods", default="ar,auto")
    ap.add_argument("--prompts", default="prose:4", metavar="KIND:N,...")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10, help="passes over every prompt and method (the first warms up)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    methods = args.methods.split(",")
    cfg = {"oracle": args.oracle, "draft": args.draft, "methods": methods, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    workers = {side: Worker(tree, cfg, Path(f"/tmp/ab-interleaved-cache-{side}"))
               for side, tree in (("before", args.before), ("after", args.after))}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    speeds: dict[str, dict[str, list[float]]] = {m: {"before": [], "after": []} for m in methods}
    identical = True
    for r in range(args.repeats):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for p in range(workers["before"].n_prompts):
            for m in methods:
                out = {side: workers[side].run(m, p) for side in order}
                tps = {side: len(o["tokens"]) / o["seconds"] for side, o in out.items()}
                identical &= out["before"]["tokens"] == out["after"]["tokens"]
                if r > 0:  # the first pass warms both up (and `auto` starts learning): not counted
                    ratios[m].append(tps["after"] / tps["before"])
                    for side in tps:
                        speeds[m][side].append(tps[side])
    for w in workers.values():
        w.close()
    summary = {"methods": {}, "identical_tokens": identical, "repeats": args.repeats, "prompts": args.prompts}
    for m in methods:
        med = statistics.median(ratios[m])
        q = statistics.quantiles(ratios[m], n=4)
        summary["methods"][m] = {"median_ratio": med, "quartiles": [q[0], q[2]], "pairs": len(ratios[m]),
                                 "median_before": statistics.median(speeds[m]["before"]),
                                 "median_after": statistics.median(speeds[m]["after"])}
        print(f"{m}: after/before median {med:.3f} [IQR {q[0]:.3f}-{q[2]:.3f}] over {len(ratios[m])} pairs; "
              f"tok/s {summary['methods'][m]['median_before']:.1f} -> {summary['methods'][m]['median_after']:.1f}")
    print("tokens identical:", identical)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
