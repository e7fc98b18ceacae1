"""Command-line arguments shared by several commands, declared once (generate, tune, serve, check, bench)."""

from __future__ import annotations

import argparse
from typing import Callable

from stagedspec.models.quant import QUANT_CHOICES


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `lo`, else argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)  # counts: tokens, nodes, requests, threads
non_negative_int = int_at_least(0)  # where 0 means something: --top-k 0 (off), --seed 0


def add_quant_arg(p: argparse.ArgumentParser) -> None:
    """`--quant`: the oracle's weight format."""
    p.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                   help="oracle weights: auto (default: a quantised GGUF source runs on its own 4-bit codes, int8 "
                        "for its 5- to 8-bit layers, on a CPU; anything else unquantised), mixed (that, forced), "
                        "int4 or int8 (every layer; groups of 32), or none (dequantised). The output head runs "
                        "int8 whenever the layers are quantised")


def threads_value(text: str) -> str | int:
    """`--threads`: "auto" or a positive count."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}") from None


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """`--threads`: how many CPU threads decode."""
    p.add_argument("--threads", type=threads_value, default="auto",
                   help="CPU threads: auto (default: PyTorch's count, the CPUs this process may use; for models "
                        "on the native kernels, whose results do not depend on it, fewer while other processes "
                        "keep some busy, re-read every 0.25 s) or a fixed count")
