"""`logit_bias`: a fixed amount added to chosen tokens' logits before anything else shapes them.

OpenAI semantics: token id -> bias in [-100, 100], added to the raw logits
(before temperature, top-k and top-p; greedy decoding takes the argmax of the
biased logits).  -100 in practice bans a token, +100 in practice forces it.
The bias does not depend on the path, so one vector serves every row of a
tree; it is applied to the oracle's p and to every draft's q alike.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError

MAX_BIAS = 100.0
MAX_ENTRIES = 1024  # OpenAI's own cap is 300; a bigger map is almost surely a mistake, and costs a dict per request


def parse_logit_bias(raw: Mapping[Any, Any], vocab_size: int) -> dict[int, float]:
    """Token id -> bias from a JSON-style mapping (keys may be decimal strings), or a one-line error.

    Why strict: a key that is not a token id of this model, or a bias outside
    [-100, 100], would otherwise be silently dropped or clamped, and the client
    could not tell that its request was not honoured.
    """
    if not isinstance(raw, Mapping):
        raise StagedSpecError("logit_bias must map token ids to numbers")
    if len(raw) > MAX_ENTRIES:
        raise StagedSpecError(f"logit_bias takes at most {MAX_ENTRIES} tokens, got {len(raw)}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        token = _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise StagedSpecError(f"logit_bias key {str(key)[:40]!r} is not a token id in [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise StagedSpecError(f"logit_bias[{token}] must be a number, got {str(value)[:40]!r}")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise StagedSpecError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


def _token_id(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key.strip())
    return None


class BiasVector:
    """The dense [V] float32 bias of one request, built once per device on first use."""

    def __init__(self, bias: Mapping[int, float], vocab_size: int) -> None:
        self.bias = dict(bias)
        self.vocab_size = vocab_size
        self._dense: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        dense = self._dense.get(device)
        if dense is None:
            dense = torch.zeros(self.vocab_size, dtype=torch.float32)
            if self.bias:
                dense[torch.tensor(list(self.bias))] = torch.tensor(list(self.bias.values()), dtype=torch.float32)
            dense = self._dense[device] = dense.to(device)
        return dense
