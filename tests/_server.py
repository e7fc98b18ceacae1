"""Run `stagedspec serve` as a subprocess on 127.0.0.1 for the server tests.

The server gets one torch thread (tiny models: threads only add wake-ups on
a shared 2-core machine) and is always stopped by the fixture that started
it; every request the tests send goes to 127.0.0.1 with a timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_folder(root: Path) -> Path:
    from _tiny_models import save_tiny_hf

    folder = root / "tiny-llama"
    if not (folder / "config.json").exists():
        save_tiny_hf("llama_gqa", folder)
    return folder


def tiny_engine(root: Path):  # noqa: ANN201 - an Engine; imported lazily like the server itself
    """The in-process tests' engine: the tiny random Llama (fp32), a 1-layer truncated draft, `tree`."""
    import torch

    from stagedspec.models.loading import load_model
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.pipeline import SpeculationConfig
    from stagedspec.server.engine import Engine

    model, tok = load_model(tiny_model_folder(root), dtype=torch.float32)
    return Engine(model, tok, [truncated_copy(model, 1)], SpeculationConfig(method="tree"),
                  model_name="tiny", draft_names=["layers:1"])


# What in-process test clients call the server: a loopback name, so the Host check lets them in (the test
# client's own default, "testserver", is a name the server refuses, as it would a rebound web page's).
LOCAL_URL = "http://127.0.0.1:8000"


def local_client(app, **kw):  # noqa: ANN001, ANN003, ANN201
    """A FastAPI `TestClient` for `app` that talks to it as a local client would."""
    from fastapi.testclient import TestClient

    return TestClient(app, base_url=LOCAL_URL, **kw)


# `stagedspec serve` with this test run's timed-choice files: the fp32 kernel plan and the draft-weight choices
# the test process uses (in the test run's cache, `conftest.py`, unless a test points them elsewhere).  A server
# on another plan could run other kernels than the test process's solo runs, whose logits then differ in the last
# bit and whose cost profiles (keyed by the plan) differ, so seeded requests chose other arms than their solo runs.
_BOOT = """
import sys
from pathlib import Path
import stagedspec.draft_weights as dw
import stagedspec.models.matmul_plan as mp
plan, weights = Path(sys.argv.pop(1)), Path(sys.argv.pop(1))
mp._cache_file, dw._cache_file = (lambda: plan), (lambda: weights)
from stagedspec.cli import main
sys.exit(main())
"""


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 90) -> None:
        import stagedspec.draft_weights as dw
        import stagedspec.models.matmul_plan as mp

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = SRC + os.pathsep + full_env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(mp._cache_file()), str(dw._cache_file()), "serve",
             "--port", str(self.port), *args],
            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"stagedspec_{name} "):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.stdout.read() if self.proc.stdout else ""
