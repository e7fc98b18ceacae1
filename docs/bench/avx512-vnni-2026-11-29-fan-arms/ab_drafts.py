"""The bundled Qwen feature draft against a candidate (argv[1]): teacher-forced top-k on the oracle's replies to
the bench prompts (this folder's `qwen-*/results.json`; evaluation only, no draft trains on them), then fixed fans
and chains of each, interleaved with `ar` in one process (prose and chat 1-4, 64 tokens, 2 rounds, greedy).

    python docs/bench/avx512-vnni-2026-11-29-fan-arms/ab_drafts.py CANDIDATE_DRAFT_FOLDER
"""
import collections, json, sys
from stagedspec.bench.prompts import CHAT, PROSE, chat_instruction, load_prompts
from stagedspec.model_set import ModelSet, load_draft_model
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.training.distill import eval_draft

models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="chain", quant="mixed")
cand = load_draft_model(sys.argv[1], models.model, models.tokenizer, models.dtype, "cpu")
drafts = {"bundled": models.draft_models[0], "cand": cand}
tok = models.tokenizer
for k in ("prose", "chat", "humaneval"):
    d = json.load(open(f"docs/bench/avx512-vnni-2026-11-29-fan-arms/qwen-{k}/results.json"))
    runs = [r for r in d["runs"] if r["method"] == "ar@mixed"]
    texts = [chat_instruction(p) if k == "humaneval" else p for p in load_prompts(k, 8)]
    ids = [tok.encode(tok.apply_chat_template(t)) for t in texts]
    streams = [ids[r["prompt_index"]] for r in runs]
    conts = [r["token_ids"][-r["new_tokens"]:] for r in runs]
    for name, dr in drafts.items():
        res = eval_draft(models.model, dr, streams, 64, timing_dtype=None, timing_steps=3, continuations=conts)
        print(k, name, {x: round(res[x], 3) for x in ("top1", "top2", "top4")}, flush=True)
fan = SpeculationConfig(method="tree", tree_budget=3, tree_depth=1, tree_branching=3)
chain = SpeculationConfig(method="chain", chain_length=2)
mk = lambda dr, s: Pipeline(models.model, models.tokenizer, [dr], s, models.ngram, device=models.device, dtype=models.dtype)
pipes = {"ar": mk(drafts["bundled"], SpeculationConfig(method="ar"))}
for name, dr in drafts.items():
    pipes[f"fan3-{name}"] = mk(dr, fan)
    pipes[f"chain2-{name}"] = mk(dr, chain)
for p in pipes.values():
    p.generate(PROSE[6], max_new_tokens=8, chat=True)
tot = collections.defaultdict(lambda: [0.0, 0, 0])
for _ in range(2):
    for kind, prompts in (("prose", PROSE[:4]), ("chat", CHAT[:4])):
        for q in prompts:
            for k, p in pipes.items():
                st = p.generate(q, max_new_tokens=64, chat=True).stats
                t = tot[(k, kind)]; t[0] += st.seconds - st.prefill_seconds; t[1] += st.new_tokens; t[2] += st.oracle_forward_passes
for kind in ("prose", "chat"):
    base = tot[("ar", kind)][1] / tot[("ar", kind)][0]
    for k in pipes:
        s, n, steps = tot[(k, kind)]
        print(f"{kind:6s} {k:16s} {n/s:6.2f} tok/s {n/s/base:5.3f}x {n/steps:5.2f} tok/step")
