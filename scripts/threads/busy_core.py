"""Plain decoding with one core taken by another process, against the same decoding on an idle machine.

Why: on a 2-core machine every kernel call is a parallel region whose threads meet at a barrier, and a core
shared with another process makes each region wait a scheduler time slice for its descheduled thread
(`docs/kernels.md`, "Threads on a busy machine").  The target: `ar` keeps at least 40% of its idle speed
while a busy loop holds one core.  This loads the default model once and alternates, per repeat, idle and
busy runs of the same prompt, for `--threads auto` (the default: `stagedspec.threads.ThreadGovernor`) and a
fixed thread count (what the default replaced), and reports tok/s and the busy / idle ratio of each.

    python scripts/threads/busy_core.py --json busy-core.json

The busy process is a Python loop pinned to the first allowed CPU.  Needs at least 2 allowed CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test."


def busy_process(cpu: int) -> subprocess.Popen:
    """A process that keeps `cpu` busy until killed."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    from stagedspec.hardware import describe
    from stagedspec.pipeline import Pipeline, SpeculationConfig
    from stagedspec.threads import allowed_cpus

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fixed-threads", type=int, default=len(allowed_cpus()),
                    help="the fixed thread count run beside --threads auto (default: every allowed CPU)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = ap.parse_args()
    cpus = allowed_cpus()
    if len(cpus) < 2:
        sys.exit("busy_core: needs at least 2 allowed CPUs")

    pipe = Pipeline.load("default", speculation=SpeculationConfig.tuned("ar", "auto"), quant="auto")
    pipe.generate(PROMPT, chat=True, max_new_tokens=8)  # kernels and cost profile, untimed

    pipes = {}
    for setting in ("auto", args.fixed_threads):  # one pipeline per thread setting, over the same loaded model
        pipes[setting] = Pipeline(pipe.model, pipe.tokenizer, [], pipe.speculation, learned=pipe.learned)
        pipes[setting].threads = setting

    def run(threads: str | int) -> float:
        t = time.perf_counter()
        out = pipes[threads].generate(PROMPT, chat=True, max_new_tokens=args.max_new_tokens)
        return len(out.token_ids) / (time.perf_counter() - t)

    settings: list[str | int] = ["auto", args.fixed_threads]
    figures: dict[str, dict[str, list[float]]] = {str(s): {"idle": [], "busy": []} for s in settings}
    for _ in range(args.repeats):
        for s in settings:
            figures[str(s)]["idle"].append(run(s))
            hog = busy_process(cpus[0])
            try:
                time.sleep(0.5)  # the loop is running and the governor has seen it
                figures[str(s)]["busy"].append(run(s))
            finally:
                hog.kill()
                hog.wait()
            time.sleep(0.5)
    print(f"{describe('cpu')}; ar, {args.max_new_tokens} tokens, median of {args.repeats}")
    print(f"{'threads':8} {'idle tok/s':>11} {'busy tok/s':>11} {'busy/idle':>10}")
    rows = []
    for s, f in figures.items():
        idle, busy = statistics.median(f["idle"]), statistics.median(f["busy"])
        rows.append({"threads": s, "idle_tok_s": f["idle"], "busy_tok_s": f["busy"], "ratio": busy / idle})
        print(f"{s:8} {idle:11.1f} {busy:11.1f} {busy / idle:10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": describe("cpu"), "weights": pipe.weights_description, "prompt": PROMPT,
                       "max_new_tokens": args.max_new_tokens, "pid": os.getpid(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
