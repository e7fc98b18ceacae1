"""What a JSON-schema constraint costs: tok/s and mean accepted length with and without it, per method.

Why: the grammar masks every row the oracle and the drafts score (one mask per tree node, about 40-50 us
each on the default model's 49k vocabulary once warm), and they also change what the drafts propose (a
draft that would have written prose now proposes JSON).  This runs the same chat prompts with and
without a schema on the default model and reports both effects, and checks that every method's greedy
tokens equal `ar`'s under the same constraint.

    python scripts/grammar/cost.py                                   # the default: 3 prompts, 96 tokens
    python scripts/grammar/cost.py --prompts 1 --max-new-tokens 8 --methods ar,tree   # an end-to-end check

Timings are only meaningful on an otherwise idle machine.  Needs llguidance (`pip install -e '.[grammar]'`).
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "Describe a fictional person: their name, age and three hobbies.",
    "Give the capital, population and two famous landmarks of a country you like.",
    "Invent a book: its title, author, year and a one-line summary.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "number": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "summary": {"type": "string"},
    },
    "required": ["name", "number", "items", "summary"],
    "additionalProperties": False,
}


def main() -> None:
    from stagedspec.constraints import GrammarSpec, LogitControls
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="ar,chain,tree,lookup,staged,auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="auto", help="the oracle's weights, as `generate --quant` (default: auto)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows (without token ids) to FILE")
    args = ap.parse_args()

    base = Pipeline.load("default", ["default"], speculation=SpeculationConfig.tuned("tree", args.quant),
                         dtype=args.dtype, quant=args.quant)
    controls = LogitControls(grammar=GrammarSpec.json_schema(SCHEMA))
    base.grammar_compiler()  # built once (about a second), outside the timings
    prompts = PROMPTS[: args.prompts]
    rows = []
    for method in args.methods.split(","):
        spec = SpeculationConfig.tuned(method, args.quant, ngram=None)
        drafts = [] if method in ("ar", "lookup") else base.draft_models
        pipe = Pipeline(base.model, base.tokenizer, drafts, spec, learned=base.learned,
                        grammar_compiler=base.grammar_compiler())  # the built vocabulary, shared
        for ctl in (None, controls):  # warm-up: kernels, the cost profile and the policy's first steps, untimed
            pipe.generate(prompts[0], chat=True, max_new_tokens=8, controls=ctl)
        for label, ctl in (("free", None), ("json-schema", controls)):
            tokens = seconds = 0.0
            steps = accepted = 0
            ids = []
            for prompt in prompts:
                t0 = time.perf_counter()
                out = pipe.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, controls=ctl)
                seconds += time.perf_counter() - t0
                tokens += len(out.token_ids)
                steps += len(out.stats.accepted_lengths)
                accepted += sum(out.stats.accepted_lengths)
                ids.append(out.token_ids)
            rows.append({"method": method, "constraint": label, "tok_s": tokens / seconds,
                         "mean_accepted_length": (accepted + steps) / steps if steps else 0.0, "ids": ids})
    reference = {r["constraint"]: r["ids"] for r in rows if r["method"] == "ar"}
    print(f"{'method':8} {'constraint':12} {'tok/s':>8} {'mean acc. len':>14}  same tokens as ar")
    for r in rows:
        same = reference.get(r["constraint"]) == r["ids"] if reference else "n/a"
        print(f"{r['method']:8} {r['constraint']:12} {r['tok_s']:8.1f} {r['mean_accepted_length']:14.2f}  {same}")
    if args.json:
        from stagedspec.hardware import describe

        kept = [{k: v for k, v in r.items() if k != "ids"} | {"same_tokens_as_ar": reference.get(r["constraint"]) == r["ids"]}
                for r in rows]
        with open(args.json, "w") as f:
            json.dump({"machine": describe("cpu"), "quant": args.quant, "weights": base.weights_description,
                       "prompts": prompts, "max_new_tokens": args.max_new_tokens, "rows": kept}, f, indent=1)
    sample = next(r for r in rows if r["constraint"] == "json-schema")["ids"][0]
    print("a constrained reply:", json.dumps(base.tokenizer.decode(sample, skip_special_tokens=True))[:200])


if __name__ == "__main__":
    main()
