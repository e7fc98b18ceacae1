"""Send N chat requests to a running `stagedspec serve` one at a time, then all at once, and compare.

The server's exactness claim, checked on a real model: a request's greedy output, and its seeded sample, are
token-identical whatever else the server is running.  Each request is a HumanEval prompt as a chat instruction,
`--max-tokens` tokens, seed 1000 + i; the token ids come from the `stagedspec` extension of the final chunk.

    stagedspec serve &
    python scripts/serve/concurrent_equals_alone.py --url http://127.0.0.1:8000/v1 --requests 16 --max-tokens 160
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import openai

from stagedspec.bench.prompts import chat_instruction, humaneval_prompts


async def one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, temperature: float,
              seed: int) -> tuple[list[int] | None, str]:
    text, ids = "", None
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                  stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                ids = (chunk.model_extra or {}).get("stagedspec", {}).get("token_ids")
    return ids, text


async def main(args: argparse.Namespace) -> dict:
    prompts = [chat_instruction(p) for p in humaneval_prompts(args.requests)]
    out = {}
    async with openai.AsyncOpenAI(base_url=args.url, api_key="none", max_retries=0, timeout=1800) as client:
        model = (await client.models.list()).data[0].id
        for temperature in args.temperatures:
            def call(i: int, temperature: float = temperature):  # a request of this temperature
                return one(client, model, prompts[i], args.max_tokens, temperature, 1000 + i)

            t0 = time.perf_counter()
            alone = [await call(i) for i in range(len(prompts))]
            t1 = time.perf_counter()
            together = await asyncio.gather(*(call(i) for i in range(len(prompts))))
            t2 = time.perf_counter()
            same = sum(a == b and a[0] is not None for a, b in zip(alone, together))
            out[str(temperature)] = {"identical": same, "requests": len(prompts),
                                     "tokens": sum(len(a[0] or []) for a in alone),
                                     "alone_seconds": round(t1 - t0, 1), "together_seconds": round(t2 - t1, 1),
                                     "differing": [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]}
            print(f"T={temperature:g}: {same}/{len(prompts)} identical (token ids and text)", flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--json", default=None, metavar="FILE", help="write the result here too")
    args = ap.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
