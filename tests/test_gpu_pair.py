"""The Qwen pair's GPU bench scripts (scripts/gpu_pair/): they parse, refuse what they cannot do, and the bench
they start is a valid command for the CLI.

The bench runs where no test can follow it (a lent GPU, one attempt per session, about 30 device calls), so its
commands are checked here: a typo found on the device costs the session's device time.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_pair"


@pytest.mark.parametrize("name", ["prepare.sh", "remote.sh"])
def test_gpu_pair_scripts_parse(name: str) -> None:
    run = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_remote_script_refuses_an_unknown_call() -> None:
    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), "nonsense"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage" in run.stderr


@pytest.mark.parametrize("call", ["again", "trace"])
def test_a_rerun_before_the_models_are_joined_says_so(call: str, tmp_path: Path) -> None:
    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), call], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 1 and "no joined GGUFs" in run.stdout


@pytest.mark.parametrize("env", [{}, {"DTYPE": "fp32", "TEMPS": "0", "TOKENS": "64"}, {"BIT_EXACT": "1"}])
def test_the_bench_command_is_valid_for_the_cli(env: dict[str, str]) -> None:
    from stagedspec.cli import build_parser

    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), "start"], capture_output=True, text=True,
                         env={**os.environ, "DRYRUN": "1", **env})
    assert run.returncode == 0, run.stderr
    args = build_parser().parse_args(shlex.split(run.stdout)[1:])
    assert args.func.__name__ == "cmd_bench" and args.device == "cuda"
    assert args.dtype == env.get("DTYPE", "bf16") and args.max_new_tokens == int(env.get("TOKENS", "96"))
    assert set(args.methods.split(",")) == {"ar", "chain", "tree", "lookup", "staged", "auto"}
    assert (args.bit_exact is True) == ("BIT_EXACT" in env)
