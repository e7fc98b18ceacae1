"""The Qwen feature draft's GPU training scripts (scripts/gpu_feature/): they parse, refuse what they cannot do,
and the distillation they start is a valid command for the CLI, with the recipe the README states.

The run happens where no test can follow it (a lent GPU, 15 device-minutes a session, about 22 calls), so its
commands are checked here: a typo found on the device costs the session's device time.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_feature"


@pytest.mark.parametrize("name", ["prepare.sh", "remote.sh"])
def test_gpu_feature_scripts_parse(name: str) -> None:
    run = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_remote_script_refuses_an_unknown_call() -> None:
    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), "nonsense"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage" in run.stderr


@pytest.mark.parametrize("env", [{}, {"TOKENS": "1000000", "TRAIN_MINUTES": "3", "SEED": "11"}])
def test_the_distillation_command_is_valid_for_the_cli(env: dict[str, str]) -> None:
    from stagedspec.cli import build_parser

    run = subprocess.run(["bash", str(SCRIPTS / "remote.sh"), "start"], capture_output=True, text=True,
                         env={**os.environ, "DRYRUN": "1", **env})
    assert run.returncode == 0, run.stderr
    args = build_parser().parse_args(shlex.split(run.stdout)[1:])
    assert args.func.__name__ == "cmd_distill" and args.device == "cuda" and args.kind == "feature"
    assert args.init_from == "/tmp/m/start" and args.head_from_oracle and args.vocab_top == 24576
    assert args.tokens == int(env.get("TOKENS", "3000000")) and args.max_minutes == float(env.get("TRAIN_MINUTES", "5"))
    assert args.seed == int(env.get("SEED", "9")) and args.save_dtype is not None
    assert (args.seq_len, args.batch_size, args.ttt_steps) == (512, 32, 3)
