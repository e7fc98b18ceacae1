"""Tokens/s by prompt kind over `ar`'s, from bench results.json files whose prompts are 8 code, 4 prose, 4 chat.

    python kinds.py bf16/results.json fp32/results.json
"""
import json, statistics as st, sys
kinds = {"code": range(0, 8), "prose": range(8, 12), "chat": range(12, 16)}
for f in sys.argv[1:]:
    r = json.load(open(f))
    runs = r["runs"]
    temps = sorted({x["temperature"] for x in runs})
    for t in temps:
        tok = {}
        for x in runs:
            if x["temperature"] == t:
                tok.setdefault(x["method"], {}).setdefault(x["prompt_index"], []).append(x)
        ar = tok["ar"]
        print(f, "T=", t)
        for m, per in tok.items():
            row = []
            for k, idx in kinds.items():
                # aggregate tok/s ratio over prompts of this kind: sum tokens / sum seconds
                def agg(d):
                    ts = sum(sum(y["new_tokens"] for y in d[i]) for i in idx if i in d)
                    s = sum(sum(y["seconds"] for y in d[i]) for i in idx if i in d)
                    return ts / s if s else float("nan")
                acc = [a for i in idx if i in per for y in per[i] for a in (y["accepted_lengths"] or [])]
                row.append(f"{k} {agg(per)/agg(ar):.2f}x acc {st.mean(acc) if acc else 1:.2f}")
            print(f"  {m:8s}", " | ".join(row))
