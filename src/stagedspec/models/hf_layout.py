"""How HF checkpoints spell things: required config integers, the RoPE base, GPT-2's Conv1D weights.

Why its own module: the Llama/GPT-2 translation (`loading`), Gemma-3's
(`gemma3`) and the GGUF readers (`gguf_read`) all need these, and `loading`
calls the other two.  Kept below all of them, no translator imports the
loader that dispatches to it.
"""

from __future__ import annotations

from typing import Any, Mapping

from stagedspec.errors import StagedSpecError

# GPT-2's weights that HF stores as Conv1D [in, out] (nn.Linear and GGUF hold them as [out, in]).
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def req_int(c: Mapping[str, Any], key: str) -> int:
    """A required positive integer from the config, or an error naming the key."""
    value = c.get(key)
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = 0
    if n <= 0 or isinstance(value, bool):
        raise StagedSpecError(f"model config has no valid {key!r} (got {value!r})")
    return n


def rope_params(c: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> float:
    """RoPE base, from the legacy `rope_theta`/`rope_scaling` keys or transformers 5's `rope_parameters`.

    `params`: one layer type's entry of a per-layer-type `rope_parameters` (Gemma-3).
    """
    params = c.get("rope_parameters") or {} if params is None else params
    scaling = c.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", None):
            raise StagedSpecError(f"unsupported RoPE scaling type {kind!r}")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise StagedSpecError("unsupported config: partial rotary embeddings")
    return float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
