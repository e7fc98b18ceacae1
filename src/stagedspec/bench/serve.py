"""`stagedspec bench-serve`: load a running server the way users do, through the official `openai` client.

For each speculation method (the server's default, then `ar`: speculation
on vs off) and each concurrency level, `--requests` streamed completions run
with at most that many in flight.  Reported per level: aggregate tokens/s
(all tokens / wall time), time to first token, per-request tokens/s (p50,
p95) and the mean accepted length (tokens per oracle step, from the
`stagedspec` extension of the final chunk).

`--llamacpp MODEL` also drives llama.cpp's `llama-server` (built by
`scripts/llamacpp/build.sh`) on MODEL's GGUF, with the same prompts, token
budget, thread count and concurrency levels, through the same client: plain
decoding, and its draft-model speculation when `--llamacpp-draft` names a
GGUF draft.  It serves `-np` = the top concurrency level, so every level
runs its requests side by side as ours do.

`--soak-minutes M` runs a soak instead: the top concurrency level kept busy
for M minutes, every error counted, and the server's resident memory read
from `/metrics` every `--soak-sample` seconds.  It passes when no request
failed and the resident memory after the warm-up (the first fifth of the
run) never rose more than `--soak-tolerance` (5%) above its first reading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from stagedspec.bench.prompts import chat_instruction, load_prompts
from stagedspec.errors import StagedSpecError


@dataclass
class RequestResult:
    tokens: int
    seconds: float
    first_token_seconds: float
    steps: float  # oracle steps (tokens / mean accepted length)


@dataclass
class LevelResult:
    method: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_second: float
    ttft_p50: float
    ttft_p95: float
    request_tps_p50: float
    request_tps_p95: float
    mean_accepted_length: float


@dataclass
class SoakResult:
    minutes: float
    concurrency: int
    requests: int
    errors: int
    first_error: str
    tokens: int
    tokens_per_second: float
    warmup_seconds: float
    rss_samples: list[tuple[float, int]]  # (seconds since start, resident bytes)
    rss_after_warmup: int
    rss_max_after_warmup: int
    rss_last: int
    growth: float  # (max after warm-up - first after warm-up) / first after warm-up
    tolerance: float
    passed: bool


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def read_prompts(files: list[str] | None) -> list[str]:
    prompts: list[str] = []
    for source in files or ["humaneval"]:
        prompts.extend(load_prompts(source, None))
    if not prompts:
        raise StagedSpecError("no prompts found in the prompt files")
    return prompts


async def _one(client: Any, model: str, prompt: str, args: argparse.Namespace, method: str | None) -> RequestResult:
    extra = {"speculation": {"method": method}} if method else {}
    t0 = time.perf_counter()
    first: float | None = None
    tokens, mal = 0, 1.0
    common = dict(model=model, max_tokens=args.max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    if args.chat:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": chat_instruction(prompt)}], **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    pieces = 0  # content chunks: the token count where a server sends no usage
    async for chunk in stream:
        if chunk.choices:
            piece = chunk.choices[0].delta.content if args.chat else chunk.choices[0].text
            if piece:
                pieces += 1
                if first is None:
                    first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        ext = (chunk.model_extra or {}).get("stagedspec")
        if ext and ext.get("mean_accepted_length"):
            mal = ext["mean_accepted_length"]
    seconds = time.perf_counter() - t0
    tokens = tokens or pieces
    return RequestResult(tokens, seconds, first if first is not None else seconds, tokens / mal if mal else tokens)


async def _level(client: Any, model: str, prompts: list[str], concurrency: int, n: int,
                 args: argparse.Namespace, method: str | None, label: str | None = None) -> LevelResult:
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> RequestResult:
        async with gate:
            return await _one(client, model, prompts[i % len(prompts)], args, method)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    steps = sum(r.steps for r in results)
    tps = [r.tokens / r.seconds for r in results if r.seconds > 0]
    ttft = [r.first_token_seconds for r in results]
    return LevelResult(label or method or "server default", concurrency, n, tokens, wall, tokens / wall if wall else 0.0,
                       percentile(ttft, 0.5), percentile(ttft, 0.95), percentile(tps, 0.5), percentile(tps, 0.95),
                       tokens / steps if steps else 0.0)


def _resident_bytes(metrics_text: str) -> int | None:
    for line in metrics_text.splitlines():
        if line.startswith("stagedspec_process_resident_bytes "):
            return int(float(line.split()[1]))
    return None


def soak_verdict(samples: list[tuple[float, int]], warmup: float, tolerance: float) -> tuple[int, int, float]:
    """(first, max) resident bytes after the warm-up and the growth between them, as a fraction."""
    after = [rss for t, rss in samples if t >= warmup] or [rss for _, rss in samples[-1:]]
    if not after or after[0] <= 0:
        return 0, 0, float("inf")
    return after[0], max(after), (max(after) - after[0]) / after[0]


async def _soak(client: Any, model: str, prompts: list[str], args: argparse.Namespace, concurrency: int,
                key: str) -> SoakResult:
    import httpx

    seconds = args.soak_minutes * 60
    t0 = time.perf_counter()
    deadline = t0 + seconds
    done: list[RequestResult] = []
    errors: list[str] = []
    samples: list[tuple[float, int]] = []
    metrics_url = args.url.rstrip("/").removesuffix("/v1") + "/metrics"

    async def worker(w: int) -> None:
        i = w
        while time.perf_counter() < deadline:
            try:
                done.append(await _one(client, model, prompts[i % len(prompts)], args, None))
            except Exception as e:  # noqa: BLE001 - a soak counts every failure, whatever its kind
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            i += concurrency

    async def sampler() -> None:
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
            while True:
                try:
                    rss = _resident_bytes((await http.get(metrics_url)).text)
                    if rss:
                        samples.append((time.perf_counter() - t0, rss))
                except httpx.HTTPError as e:
                    errors.append(f"/metrics: {type(e).__name__}")
                if time.perf_counter() >= deadline:
                    return
                await asyncio.sleep(min(args.soak_sample, max(0.0, deadline - time.perf_counter())))

    await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - t0
    warmup = seconds / 5
    first, top, growth = soak_verdict(samples, warmup, args.soak_tolerance)
    tokens = sum(r.tokens for r in done)
    return SoakResult(args.soak_minutes, concurrency, len(done) + len(errors), len(errors), errors[0] if errors else "",
                      tokens, tokens / wall if wall else 0.0, warmup, samples, first, top,
                      samples[-1][1] if samples else 0, growth, args.soak_tolerance,
                      not errors and growth <= args.soak_tolerance)


async def _bench(args: argparse.Namespace) -> list[LevelResult] | SoakResult:
    import openai

    prompts = read_prompts(args.prompts)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise StagedSpecError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise StagedSpecError("--concurrency needs at least one level >= 1")
    key = args.api_key or os.environ.get("STAGEDSPEC_API_KEY") or "none"
    theirs: list[LevelResult] = []  # llama-server's levels run first: a build or start problem shows at once
    if args.llamacpp and not args.soak_minutes:
        for label, flags in _llamacpp_variants(args):
            theirs.extend(await _llamacpp_levels(args, prompts, levels, label, flags))
    async with openai.AsyncOpenAI(base_url=args.url, api_key=key, max_retries=0, timeout=600) as client:
        try:
            model = args.model or (await client.models.list()).data[0].id
        except openai.APIConnectionError:
            raise StagedSpecError(f"cannot reach a server at {args.url}: start one with `stagedspec serve`") from None
        except openai.APIStatusError as e:
            raise StagedSpecError(f"the server at {args.url} answered {e.status_code}: {e.message}") from None
        if args.soak_minutes:
            return await _soak(client, model, prompts, args, max(levels), key)
        methods: list[str | None] = [m.strip() for m in args.methods.split(",")] if args.methods else [None, "ar"]
        out = []
        for method in methods:
            for c in levels:
                try:
                    out.append(await _level(client, model, prompts, c, args.requests or 2 * c, args, method))
                except openai.APIStatusError as e:
                    raise StagedSpecError(f"the server refused a request ({e.status_code}): {e.message}") from None
    return out + theirs


def _llamacpp_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, llama-server flags): plain decoding, and draft-model speculation with `--llamacpp-draft`."""
    # deferred: imports torch, which the HTTP client runs without (only --llamacpp needs these)
    from stagedspec.bench.llamacpp import draft_model_flags
    from stagedspec.bench.methods import gguf_for

    variants = [("llama-server", [])]
    if args.llamacpp_draft:
        draft = gguf_for(args.llamacpp_draft)
        if draft is None:
            raise StagedSpecError(f"--llamacpp-draft {args.llamacpp_draft!r} is not a GGUF file or a named GGUF model")
        variants.append(("llama-server -md", draft_model_flags(draft, _threads(args))))
    return variants


def _threads(args: argparse.Namespace) -> int:
    """llama-server's thread count: `--llamacpp-threads`, else the CPUs this process may use (its affinity)."""
    # deferred: threads imports torch, which the HTTP client runs without
    from stagedspec.threads import allowed_cpus

    return args.llamacpp_threads or len(allowed_cpus())


async def _llamacpp_levels(args: argparse.Namespace, prompts: list[str], levels: list[int], label: str,
                           flags: list[str]) -> list[LevelResult]:
    """The same levels against a `llama-server` started here on `--llamacpp`'s GGUF, then stopped."""
    import httpx
    import openai

    # deferred: imports torch, which the HTTP client runs without (only --llamacpp needs these)
    from stagedspec.bench.llamacpp import LlamaServer, bin_dir
    from stagedspec.bench.methods import MethodSkipped, gguf_for

    folder = bin_dir()
    if folder is None:
        raise StagedSpecError("llama.cpp is not built: run scripts/llamacpp/build.sh (or set STAGEDSPEC_LLAMACPP_BIN)")
    gguf = gguf_for(args.llamacpp)
    if gguf is None:
        raise StagedSpecError(f"--llamacpp {args.llamacpp!r} is not a GGUF file or a named GGUF model")
    try:
        server = await asyncio.to_thread(LlamaServer, folder / "llama-server", gguf, flags, _threads(args),
                                         args.llamacpp_context, max(levels))
    except MethodSkipped as e:
        raise StagedSpecError(str(e)) from None
    # No kept-alive connections: llama-server closes idle ones after a few seconds, and the client's next
    # request on such a connection fails ("Server disconnected without sending a response").
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)
    try:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, http_client=http) as client:
            model = (await client.models.list()).data[0].id
            return [await _level(client, model, prompts, c, args.requests or 2 * c, args, None, label)
                    for c in levels]
    except openai.APIError as e:
        cause = f" ({e.__cause__!r})" if e.__cause__ else ""
        tail = " | ".join(server.log_tail(2))
        raise StagedSpecError(f"llama-server failed a request: {e}{cause}; its log ends: {tail}") from None
    finally:
        server.close()


def run_bench_serve(args: argparse.Namespace) -> int:
    results = asyncio.run(_bench(args))
    if isinstance(results, SoakResult):
        return _print_soak(results, args.json)
    if args.json:
        print(json.dumps({"levels": [asdict(r) for r in results]}))
        return 0
    print(f"{'method':>16} {'conc':>4} {'reqs':>4} {'agg tok/s':>9} {'TTFT p50':>8} {'TTFT p95':>8} "
          f"{'req tok/s p50':>13} {'p95':>7} {'acc len':>7}")
    for r in results:
        print(f"{r.method:>16} {r.concurrency:>4} {r.requests:>4} {r.tokens_per_second:>9.1f} {r.ttft_p50:>8.2f} "
              f"{r.ttft_p95:>8.2f} {r.request_tps_p50:>13.1f} {r.request_tps_p95:>7.1f} "
              f"{r.mean_accepted_length:>7.2f}")
    theirs = [r for r in results if r.method.startswith("llama-server")]
    results = [r for r in results if not r.method.startswith("llama-server")]
    methods = list(dict.fromkeys(r.method for r in results))
    if theirs and methods:
        by = {(r.method, r.concurrency): r for r in results + theirs}
        for label in dict.fromkeys(r.method for r in theirs):
            print(f"\n{methods[0]} vs {label}, aggregate tokens/s (TTFT p50):")
            for c in sorted({r.concurrency for r in theirs}):
                a, b = by.get((methods[0], c)), by.get((label, c))
                if a and b and b.tokens_per_second:
                    print(f"  concurrency {c}: {a.tokens_per_second:.1f} ({a.ttft_p50:.2f} s) vs "
                          f"{b.tokens_per_second:.1f} ({b.ttft_p50:.2f} s) = "
                          f"{a.tokens_per_second / b.tokens_per_second:.2f}x")
    if len(methods) >= 2:
        on, off = methods[0], methods[-1]
        by = {(r.method, r.concurrency): r for r in results}
        print(f"\nspeculation on ({on}) vs off ({off}), aggregate tokens/s:")
        for c in sorted({r.concurrency for r in results}):
            a, b = by.get((on, c)), by.get((off, c))
            if a and b and b.tokens_per_second:
                print(f"  concurrency {c}: {a.tokens_per_second:.1f} vs {b.tokens_per_second:.1f} "
                      f"= {a.tokens_per_second / b.tokens_per_second:.2f}x")
    base = [r for r in results if r.method == methods[0]]
    if len(base) >= 2 and base[0].tokens_per_second:
        top = max(base, key=lambda r: r.concurrency)
        print(f"scaling ({methods[0]}): concurrency {top.concurrency} gives "
              f"{top.tokens_per_second / base[0].tokens_per_second:.2f}x concurrency {base[0].concurrency}")
    return 0


def _print_soak(r: SoakResult, as_json: bool) -> int:
    """Print the soak's verdict; exit status 1 when it failed (an error, or memory growth)."""
    if as_json:
        print(json.dumps({"soak": asdict(r)}))
        return 0 if r.passed else 1
    mib = 2 ** 20
    print(f"soak: {r.minutes:g} min at concurrency {r.concurrency}: {r.requests} requests, {r.errors} errors, "
          f"{r.tokens} tokens, {r.tokens_per_second:.1f} tok/s aggregate")
    if r.errors:
        print(f"  first error: {r.first_error}")
    print(f"  resident memory: {r.rss_after_warmup / mib:.1f} MiB after the {r.warmup_seconds:.0f} s warm-up, "
          f"at most {r.rss_max_after_warmup / mib:.1f} MiB later (+{100 * r.growth:.2f}%, tolerance "
          f"{100 * r.tolerance:g}%), {r.rss_last / mib:.1f} MiB at the end; {len(r.rss_samples)} readings")
    print(f"result: {'PASS' if r.passed else 'FAIL'}")
    return 0 if r.passed else 1
