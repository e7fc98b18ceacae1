"""Command-line arguments shared by several commands, declared once (generate, tune, serve, check)."""

from __future__ import annotations

import argparse

from stagedspec.models.quant import QUANT_CHOICES


def add_quant_arg(p: argparse.ArgumentParser) -> None:
    """`--quant`: the oracle's weight format."""
    p.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                   help="oracle weights: auto (default: a quantised GGUF source runs on its own 4-bit codes, int8 "
                        "for its 5- to 8-bit layers, on a CPU; anything else unquantised), mixed (that, forced), "
                        "int4 or int8 (every layer; groups of 32), or none (dequantised). The output head runs "
                        "int8 whenever the layers are quantised")
