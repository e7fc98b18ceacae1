"""llama.cpp beside our methods in `stagedspec bench`: `llamacpp`, `llamacpp-spec`, `llamacpp-ngram`.

Why `llama-server` and not a command per prompt: the model loads once, the
server keeps it, and each prompt is one `/completion` request whose own
timings (prompt and generation milliseconds, draft tokens proposed and
accepted) come back with the generated token ids.  The prompts are sent as
token ids, so llama.cpp decodes exactly the sequence our methods decode.

- `llamacpp`: plain decoding;
- `llamacpp-spec`: its draft-model speculation (`-md DRAFT.gguf`, up to
  `SPEC_DRAFT_MAX` tokens a step), with the bench's draft when that is a GGUF;
- `llamacpp-ngram`: its `ngram-mod` drafting (no draft model).

The binaries come from `scripts/llamacpp/build.sh` (llama.cpp vendored in
the llama-cpp-python sdist, built with -DGGML_NATIVE=ON, cached under
`<cache>/llama.cpp-VERSION/`), or from `$STAGEDSPEC_LLAMACPP_BIN`.  Threads:
the same count as ours (`torch.get_num_threads()`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import torch

from stagedspec.bench.methods import (BenchModels, Method, MethodSkipped, Outcome, gguf_for, gguf_weight_bytes,
                                      split_draft)
from stagedspec.sampling import SamplingParams
from stagedspec.paths import cache_root

LLAMACPP = ("llamacpp", "llamacpp-spec", "llamacpp-ngram")
LLAMACPP_PY_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp the build script compiles
SPEC_DRAFT_MAX = 8  # llamacpp-spec: tokens drafted per step (--spec-draft-n-max)
START_TIMEOUT_S = 300.0


def draft_model_flags(draft_gguf: Path, threads: int) -> list[str]:
    """llama.cpp's flags for draft-model speculation with `draft_gguf` (`llamacpp-spec`, `bench-serve`).

    `--spec-type draft-simple` is needed: this llama.cpp's `--spec-type` defaults to none, and `-md` alone
    loads the draft and never drafts with it (docs/benchmarks-history.md marks the runs measured that way)."""
    return ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(SPEC_DRAFT_MAX),
            "-td", str(threads)]


def _build_record() -> dict[str, str]:
    """The build script's record of which build passed its smoke test (`<cache>/llama.cpp-VERSION/BUILD`:
    `dir=` and `build=` lines); empty where the script predates it or never ran."""
    path = cache_root() / f"llama.cpp-{LLAMACPP_PY_VERSION}" / "BUILD"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def bin_dir() -> Path | None:
    """Where llama-server is: $STAGEDSPEC_LLAMACPP_BIN, else the build the script recorded (the native one, or
    the one without AMX where the native one died in its smoke test), else the native build folder, else None."""
    env = os.environ.get("STAGEDSPEC_LLAMACPP_BIN")
    build = _build_record().get("dir", "build")
    folder = Path(env) if env else cache_root() / f"llama.cpp-{LLAMACPP_PY_VERSION}" / build / "bin"
    return folder if (folder / "llama-server").is_file() else None


def build_flavour() -> str:
    """Which llama.cpp build the bench runs, in words (`scripts/llamacpp/build.sh`)."""
    if os.environ.get("STAGEDSPEC_LLAMACPP_BIN"):
        return "from $STAGEDSPEC_LLAMACPP_BIN"
    return _build_record().get("build", "native (-DGGML_NATIVE=ON)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One `llama-server` process on the loopback interface, started with `flags`, stopped by `close()`."""

    def __init__(self, binary: Path, model: Path, flags: Sequence[str], threads: int, context: int,
                 parallel: int = 1) -> None:
        """`context`: tokens per request; `parallel`: requests served at once (`-np`, slots of `context` each)."""
        self.port = _free_port()
        self.args = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                     "-c", str(context * parallel), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(parallel), "--no-webui", *flags]
        # Its log goes to a file: a pipe nobody reads fills after some hundred requests and stalls the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail(3)
                raise MethodSkipped(f"llama-server exited at start: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise MethodSkipped(f"llama-server did not answer within {START_TIMEOUT_S:.0f} s")

    def log_tail(self, lines: int) -> list[str]:
        """The last `lines` lines of the server's log."""
        self.log.seek(0)
        return self.log.read().strip().splitlines()[-lines:]

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (`/v1`)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def complete(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        greedy = sampling.greedy
        body = {"prompt": ids, "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "seed": seed, "temperature": 0.0 if greedy else sampling.temperature,
                "top_k": 1 if greedy else sampling.top_k, "top_p": 1.0 if greedy else sampling.top_p,
                "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def build_info(folder: Path) -> str:
    """`llama-server --version`'s first line (version and commit)."""
    try:
        out = subprocess.run([str(folder / "llama-server"), "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def llamacpp_method(models: BenchModels, name: str, max_context: int, draft: str | None) -> Method:
    """`llamacpp`, `llamacpp-spec` or `llamacpp-ngram` on the oracle's GGUF (see the module docstring)."""
    if models.device != "cpu":
        raise MethodSkipped("llama.cpp runs are CPU-only here")
    folder = bin_dir()
    if folder is None:
        raise MethodSkipped("llama.cpp is not built: run scripts/llamacpp/build.sh (or set STAGEDSPEC_LLAMACPP_BIN)")
    gguf = gguf_for(models.oracle_spec)
    if gguf is None:
        raise MethodSkipped("the oracle is not a GGUF, so llama.cpp has no file with the same weights")
    flags: list[str] = []
    draft_bytes: list[int] = []
    kind = "baseline"
    base = split_draft(name)[0]  # `llamacpp-spec/DRAFT.gguf` names its own draft (`draft` is already it)
    if base == "llamacpp-spec":
        draft_gguf = gguf_for(draft) if draft and draft != "default" else None  # "default": our distilled draft
        if draft_gguf is None:
            raise MethodSkipped("llama.cpp's draft-model speculation needs the draft as a GGUF (--draft FILE.gguf)")
        flags = draft_model_flags(draft_gguf, torch.get_num_threads())
        draft_bytes = [gguf_weight_bytes(draft_gguf)]
        kind = "spec"
    elif base == "llamacpp-ngram":
        flags = ["--spec-type", "ngram-mod"]
        kind = "lookup"
    threads = torch.get_num_threads()
    server = LlamaServer(folder / "llama-server", gguf, flags, threads, max_context)

    def run(ids: list[int], max_new_tokens: int, sampling: SamplingParams, seed: int) -> Outcome:
        t0 = time.perf_counter()
        reply = server.complete(ids, max_new_tokens, sampling, seed)
        wall = time.perf_counter() - t0
        timings = reply.get("timings", {})
        tokens = [int(t) for t in reply.get("tokens", [])]
        seconds = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1e3 or wall
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        steps = max(1, len(tokens) - int(accepted or 0))  # each verification pass emits accepted + 1 tokens
        finish = "stop" if reply.get("stop_type") in ("eos", "word") else "length"
        out = Outcome(tokens, seconds, steps, [], finish_reason=finish)
        if drafted is not None:
            out.accepted_lengths = None  # per-step counts are not reported; the mean is (settings)
            out.stage_seconds = {"llama.cpp accepted/drafted": float(accepted or 0) / max(1, int(drafted))}
        return out

    build = build_info(folder)
    desc = f"llama.cpp {build} (llama-server, {threads} threads) on {gguf.name}" + {
        "baseline": ", plain",
        "spec": f", draft {Path(flags[1]).name if flags else ''} (--spec-draft-n-max {SPEC_DRAFT_MAX})",
        "lookup": ", ngram-mod drafting"}[kind]
    settings = {"gguf": str(gguf), "llama_cpp_build": build, "flags": flags, "threads": threads,
                "oracle_bytes": gguf_weight_bytes(gguf), "draft_bytes": draft_bytes,
                "llama_cpp_source": f"llama-cpp-python {LLAMACPP_PY_VERSION} sdist (vendored), {build_flavour()}"}
    return Method(name, "llama.cpp", kind, desc, run, settings, close=server.close)
