"""Distilled draft models: a few oracle-width layers on top of the oracle's own embedding.

A draft is only useful if it is much cheaper than the oracle and agrees with
it often.  Giving it the oracle's width, heads and vocabulary lets it start
from copies of oracle layers (which already read the oracle's residual-stream
features) and share the oracle's token embedding: the embedding is by far the
largest tensor of a small model and the draft never trains it, so it is
neither duplicated in memory nor stored in the draft file.

The output head is either the oracle's (shared, frozen) or the draft's own
head over the V' most frequent tokens.  A restricted head is the cheap option:
for SmolLM2-135M the full head (49152 x 576) weighs about four times as much
as two layers.  Tokens outside the subset get logit -inf, i.e. probability 0, so the
tree builder never proposes them; exactness does not suffer because the
oracle verifies every token and emits its own choice when the draft missed.

On disk a draft is a folder:

    draft_config.json   format/version, ModelConfig, oracle layers used for
                        initialisation, vocab size, head layout, fingerprint
                        of the oracle/tokenizer it was trained for, training
                        metadata
    draft.safetensors   the draft's own weights only (layers, final norm,
                        restricted head and its token ids), bf16 by default
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stagedspec.cache import KVCache
from stagedspec.errors import StagedSpecError
from stagedspec.models.quant import dequantized_copy
from stagedspec.models.transformer import Attention, Transformer, apply_rope
from stagedspec.paths import write_text_atomic

FORMAT = "stagedspec-draft"
FORMAT_VERSION = 1
FEATURE_FORMAT_VERSION = 2  # drafts with `kind: "feature"` (see `stagedspec.models.feature_draft`)
INDEPENDENT = "independent"  # the draft kinds: reads tokens only, or the oracle's features too
KINDS = (INDEPENDENT, "feature")
CONFIG_NAME = "draft_config.json"
WEIGHTS_NAME = "draft.safetensors"
DEFAULT_DRAFT_NAME = "draft-smollm2-135m"
# Drafts bundled with the package, one per known oracle; `--draft default` picks the one whose recorded
# tokenizer fingerprint is the oracle's.
BUNDLED_DRAFTS = {"draft-smollm2-135m": "SmolLM2-135M-Instruct (--oracle default)",
                  "draft-gemma3-270m": "Gemma-3-270m (--oracle gemma3-270m)",
                  "draft-qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct (--oracle qwen2.5-coder-1.5b)"}
# The oracle specs that have a bundled draft, for commands that decide before loading anything.
ORACLES_WITH_DRAFTS = ("default", "gemma3-270m", "qwen2.5-coder-1.5b")

# Parameters taken from the oracle when the draft is built; never trained, never saved.
_SHARED_PREFIXES = ("embed.", "pos_embed.", "shared_head")


def assets_dir() -> Path:
    """The folder of the drafts bundled with the package."""
    return Path(__file__).resolve().parent.parent / "assets"


def bundled_draft_for(fingerprint: str, hidden_size: int | None = None) -> Path | None:
    """The bundled draft trained for the oracle whose tokenizer has this fingerprint (and, where given, this
    width), if any.

    Why the width: one tokenizer serves several oracles (Qwen2.5-Coder-1.5B and -0.5B), and a draft reads its
    oracle's embedding and features, so it fits only the oracle of the width it was made for."""
    for folder, recorded in bundled_drafts_for(fingerprint):
        if hidden_size is None or recorded.get("hidden_size") == hidden_size:
            return folder
    return None


def bundled_drafts_for(fingerprint: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(folder, recorded config) of each bundled draft made for the tokenizer with this fingerprint; a folder
    whose config is missing or unreadable is passed over."""
    for name in BUNDLED_DRAFTS:
        folder = assets_dir() / name
        try:
            recorded = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(recorded, dict) and recorded.get("fingerprint") == fingerprint:
            yield folder, recorded


def default_draft_dir(fingerprint: str | None = None, hidden_size: int | None = None) -> Path:
    """The bundled draft for the oracle with this tokenizer fingerprint (None: the default oracle's).

    Why by fingerprint: `--draft default` must work however the oracle was named (`gemma3-270m`, the
    same GGUF by path), and must never pair a draft with an oracle whose tokens it does not share.
    """
    if fingerprint is None:
        folder = assets_dir() / DEFAULT_DRAFT_NAME
        if (folder / CONFIG_NAME).is_file():
            return folder
        raise StagedSpecError(
            f"no default draft is bundled (expected {folder}); train one with distillation "
            "or pass --draft FOLDER / layers:N"
        )
    folder = bundled_draft_for(fingerprint, hidden_size)
    if folder is None:
        known = "; ".join(BUNDLED_DRAFTS.values())
        raise StagedSpecError(
            f"no bundled draft for this oracle (bundled drafts are for: {known}); train one with "
            "`stagedspec distill` or pass --draft FOLDER / layers:N"
        )
    return folder


def spread_layers(n_oracle: int, n_draft: int) -> list[int]:
    """Evenly strided oracle layers starting at the first: [0, n/k, 2n/k, ...].

    The first layer is always kept because it turns raw embeddings into the
    residual-stream features every later layer expects.  The last one is
    deliberately not forced in: measured on SmolLM2-135M (30 layers),
    an untrained [0, 29] draft has a held-out KL to the oracle of 49 nats,
    [0, 15] about 15 and [0, 1] about 14 (top-1 agreement 0%, 7%, 4%): the
    last layer misreads a residual stream that skipped the middle.
    """
    if not 1 <= n_draft <= n_oracle:
        raise StagedSpecError(f"a draft needs 1..{n_oracle} layers, got {n_draft}")
    return [(i * n_oracle) // n_draft for i in range(n_draft)]


def _frozen(t: Tensor, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A non-trainable parameter holding `t` (sharing its storage when no cast or move is needed).

    An oracle loaded under `torch.inference_mode` has inference tensors,
    which autograd refuses to save for backward (the shared head is a factor
    of the student's logits), so those are copied.
    """
    t = t.detach().to(device=device, dtype=dtype)
    return nn.Parameter(t.clone() if t.is_inference() else t, requires_grad=False)


def _make_trainable(p: nn.Parameter) -> None:
    """Own (copied) weights train even if the oracle's were frozen or inference tensors."""
    if p.is_inference():
        p.data = p.data.clone()
    p.requires_grad_(True)


class DraftModel(Transformer):
    """A `Transformer` whose forward returns full-vocabulary logits, so `ModelDrafter` takes it as is.

    Built from an oracle: `oracle_layers` are copied (trainable), the final
    norm is copied (trainable), the token/position embeddings are shared
    (frozen).  With `head_tokens` (ascending token ids) the draft owns a head
    over just those tokens, initialised from the oracle's head rows; without
    it, it uses the oracle's head (frozen, shared).
    """

    kind = INDEPENDENT  # reads tokens only (a `FeatureDraftModel` reads the oracle's features too)

    def __init__(
        self,
        oracle: Transformer,
        layers: int | Sequence[int] = 2,
        head_tokens: Tensor | Sequence[int] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        mlp_width: int | None = None,
        head_from_oracle: bool = False,
    ) -> None:
        """`mlp_width`: keep only this many of each copied layer's MLP channels (`prune_mlp`), for a draft
        that must stream fewer bytes than an oracle layer (None: the oracle's width).  `head_from_oracle`:
        the restricted head is the oracle's rows, frozen, and saved as its token ids alone."""
        ocfg = oracle.config
        picked = spread_layers(ocfg.n_layers, layers) if isinstance(layers, int) else [int(i) for i in layers]
        if not picked or any(not 0 <= i < ocfg.n_layers for i in picked):
            raise StagedSpecError(f"draft layers {picked} must be oracle layers in 0..{ocfg.n_layers - 1}")
        if mlp_width is not None and not 1 <= mlp_width <= ocfg.intermediate_size:
            raise StagedSpecError(f"a draft's MLP width must be in 1..{ocfg.intermediate_size}, got {mlp_width}")
        if head_from_oracle and head_tokens is None:
            raise StagedSpecError("a head taken from the oracle's rows needs its token ids")
        cfg = copy.deepcopy(ocfg)
        cfg.n_layers = len(picked)
        if mlp_width is not None:
            cfg.intermediate_size = int(mlp_width)
        if ocfg.local_layers:  # Gemma-3: each copied layer keeps its kind (sliding-window or global)
            cfg.local_layers = [bool(ocfg.local_layers[i]) for i in picked]
        # Build the Transformer skeleton without allocating the (large, shared) embedding.
        with torch.device("meta"):
            super().__init__(cfg)
        src = oracle.embed.weight
        dtype = dtype or src.dtype
        device = torch.device(device) if device is not None else src.device
        self.oracle_layers = picked
        self.embed = nn.Embedding(ocfg.vocab_size, ocfg.hidden_size, _weight=_frozen(src, dtype, device),
                                  _freeze=True)
        if oracle.pos_embed is not None:
            self.pos_embed = nn.Embedding(ocfg.max_position, ocfg.hidden_size,
                                          _weight=_frozen(oracle.pos_embed.weight, dtype, device), _freeze=True)
        self.layers = nn.ModuleList(dequantized_copy(oracle.layers[i]).to(device=device, dtype=dtype) for i in picked)
        if mlp_width is not None and mlp_width < ocfg.intermediate_size:
            for layer in self.layers:
                prune_mlp(layer.mlp, int(mlp_width))
        self.norm = dequantized_copy(oracle.norm).to(device=device, dtype=dtype)
        self.lm_head = None
        for name in ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"):
            if hasattr(oracle, name):
                setattr(self, name, getattr(oracle, name).to(device))
        for p in [*self.layers.parameters(), *self.norm.parameters()]:
            _make_trainable(p)
        self.training_meta: dict[str, Any] = {}
        self.fingerprint: str | None = None

        oracle_head = oracle.head_weight
        self.shared_head: nn.Parameter | None = None
        self.head: nn.Linear | None = None
        if head_tokens is None:
            self.register_buffer("head_tokens", None)
            if oracle.lm_head is not None:  # untied oracle: share its separate head
                self.shared_head = _frozen(oracle_head, dtype, device)
        else:
            ids = _check_head_tokens(torch.as_tensor(head_tokens, dtype=torch.long), ocfg.vocab_size)
            self.register_buffer("head_tokens", ids.to(device))
            self.head = nn.Linear(ocfg.hidden_size, ids.numel(), bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                self.head.weight.copy_(oracle_head.detach()[ids.to(oracle_head.device)].to(device, dtype))
        self.head_from_oracle = bool(head_from_oracle)
        if self.head_from_oracle:
            self.head.weight.requires_grad_(False)
        leftover = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        assert not leftover, f"draft skeleton left on the meta device: {leftover}"

    # ------------------------------------------------------------------ head
    @property
    def head_weight(self) -> Tensor:
        """Weight of the head actually computed: [V', H] when restricted, else the oracle's [V, H]."""
        if self.head is not None:
            return self.head.weight
        return self.embed.weight if self.shared_head is None else self.shared_head

    @property
    def support(self) -> Tensor:
        """Token ids the draft can propose, in the order of `support_logits` columns."""
        if self.head_tokens is not None:
            return self.head_tokens
        return torch.arange(self.config.vocab_size, device=self.embed.weight.device)

    def support_logits(self, h: Tensor) -> Tensor:
        """Logits over `support` only (no -inf padding): what training and ranking need.

        Gemma's final soft-cap is applied as in `Transformer.head_logits`, so training sees the logits
        decoding uses."""
        logits = F.linear(h, self.head_weight)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def expand_logits(self, logits: Tensor) -> Tensor:
        """Scatter support logits [..., V'] into full-vocabulary logits [..., V], -inf elsewhere."""
        if self.head_tokens is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.head_tokens, logits)

    # ------------------------------------------------------------------ training
    def hidden_train(self, tokens: Tensor) -> Tensor:
        """Final normalised hidden states [B, T, H] of a causal pass at positions 0..T-1, with autograd.

        Training cannot go through the KV cache: every layer writes into one
        shared buffer in place, which breaks the tensors autograd saved for
        the earlier layers.  Without a cache the pass is also cheaper.
        """
        B, T = tokens.shape
        if T > self.config.max_position:
            raise StagedSpecError(f"training sequences of {T} tokens exceed the context of {self.config.max_position}")
        positions = torch.arange(T, device=tokens.device)
        x, rope, local_rope = self.embed_rows(tokens, positions)  # Gemma's embedding scale included
        window = int(self.config.sliding_window or 0)
        for i, layer in enumerate(self.layers):
            local = bool(self.local) and self.local[i]
            h = _causal_attention(layer.attn, layer.attn_norm(x), local_rope if local else rope,
                                  window if local else 0)
            x = layer.after_attention(x, h)
        return self.norm(x)

    def forward_train(self, tokens: Tensor) -> Tensor:
        """Full-vocabulary logits [B, T, V] of a causal pass over `tokens`, differentiable."""
        return self.expand_logits(self.support_logits(self.hidden_train(tokens)))

    # ------------------------------------------------------------------ bookkeeping
    def own_state_dict(self) -> dict[str, Tensor]:
        """The draft's own tensors (what is trained and saved); shared oracle weights excluded (a head of the
        oracle's rows is kept as its token ids alone)."""
        shared = _SHARED_PREFIXES + (("head.",) if self.head_from_oracle else ())
        return {k: v for k, v in self.state_dict().items() if not k.startswith(shared)}

    def make_own_weights_trainable(self) -> None:
        """Let the draft's own weights (not the shared, frozen oracle ones) train again after loading."""
        shared = _SHARED_PREFIXES + (("head.",) if self.head_from_oracle else ())
        for name, p in self.named_parameters():
            if not name.startswith(shared):
                _make_trainable(p)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def num_bytes(self) -> int:
        """Bytes streamed per decoding step: layers (quantised codes included), final norm and the head
        that is computed."""
        tensors = [*self.layers.parameters(), *self.layers.buffers(), *self.norm.parameters()]
        tensors += [*self.head_q.parameters(), *self.head_q.buffers()] if self.head_q is not None else [self.head_weight]
        return sum(t.numel() * t.element_size() for t in tensors)


def prune_mlp(mlp: nn.Module, width: int) -> None:
    """Keep the `width` channels of a gated MLP that carry the most weight, in place.

    A channel's weight is the product of its gate and up rows' norms and its
    down column's norm: what it can add to the residual stream for an input
    of unit norm.  The kept channels compute exactly what they computed in the
    full layer, so a pruned copy of an oracle layer starts near that layer
    (the rest is what training has to make up).
    """
    w_up, w_down = mlp.w_up.weight, mlp.w_down.weight
    inner = w_down.shape[1]
    gated = w_up.shape[0] == 2 * inner
    gate, up = (w_up[:inner], w_up[inner:]) if gated else (w_up, None)
    score = gate.float().norm(dim=1) * w_down.float().norm(dim=0)
    if up is not None:
        score = score * up.float().norm(dim=1)
    keep = score.topk(width).indices.sort().values.to(w_up.device)
    rows = torch.cat([keep, keep + inner]) if gated else keep
    with torch.no_grad():
        mlp.w_up.weight = nn.Parameter(w_up[rows].clone(), requires_grad=w_up.requires_grad)
        mlp.w_down.weight = nn.Parameter(w_down[:, keep].clone(), requires_grad=w_down.requires_grad)
        if mlp.w_up.bias is not None:
            mlp.w_up.bias = nn.Parameter(mlp.w_up.bias[rows].clone(), requires_grad=mlp.w_up.bias.requires_grad)
    mlp.w_up.out_features, mlp.w_down.in_features = rows.numel(), width


def grown_layers(existing: Sequence[int], n_oracle: int, n_layers: int) -> tuple[list[int], list[bool]]:
    """Oracle layers for a draft grown from `existing` to `n_layers`, and which of them are new.

    Each new layer copies the oracle layer in the middle of the widest gap
    between the draft's layers (or after its last one), so the draft keeps
    the oracle's order of layers: [0, 15] of 30 grows to [0, 7, 15], then
    [0, 7, 15, 22].
    """
    layers = [int(i) for i in existing]
    new = [False] * len(layers)
    if n_layers < len(layers):
        raise StagedSpecError(f"a draft of {len(layers)} layers cannot shrink to {n_layers}")
    while len(layers) < n_layers:
        bounds = layers + [n_oracle]
        gaps = [(bounds[k + 1] - bounds[k], k) for k in range(len(layers)) if bounds[k + 1] - bounds[k] > 1]
        if not gaps:
            raise StagedSpecError(f"the oracle has no layer left to copy for a draft of {n_layers} layers")
        width, k = max(gaps, key=lambda g: (g[0], -g[1]))
        layers.insert(k + 1, layers[k] + width // 2)
        new.insert(k + 1, True)
    return layers, new


def grow_draft(draft: DraftModel, oracle: Transformer, n_layers: int) -> DraftModel:
    """`draft` with new layers inserted (`grown_layers`), computing exactly what `draft` computes.

    A new layer is a copy of its oracle layer whose attention output and MLP
    down projections are zero, so it adds nothing to the residual stream
    until training moves those projections (their gradients are not zero).
    More training can then start from the trained draft instead of from the
    oracle's layers.  Independent drafts only.
    """
    if type(draft) is not DraftModel:
        raise StagedSpecError("only an independent draft can grow layers")
    picked, is_new = grown_layers(draft.oracle_layers, oracle.config.n_layers, n_layers)
    p = draft.embed.weight
    grown = DraftModel(oracle, picked, draft.head_tokens, dtype=p.dtype, device=p.device)
    old = iter(draft.layers)
    with torch.no_grad():
        for layer, fresh in zip(grown.layers, is_new):
            if not fresh:
                layer.load_state_dict(next(old).state_dict())
                continue
            for proj in (layer.attn.wo, layer.mlp.w_down):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
        grown.norm.load_state_dict(draft.norm.state_dict())
        if draft.head is not None:
            grown.head.weight.copy_(draft.head.weight)
    grown.training_meta = dict(draft.training_meta)
    grown.fingerprint = draft.fingerprint
    return grown.train(draft.training)


def _causal_attention(attn: Attention, x: Tensor, rope: tuple[Tensor, Tensor] | None, window: int = 0) -> Tensor:
    """`Attention.forward` for a fresh causal sequence, without a cache (for training).

    Gemma-3's q/k norms and attention scale come from `attn`; `window` > 0 is
    a sliding window (a key is seen when `key_pos > query_pos - window`, the
    rule `Transformer.local_attention_mask` applies when decoding)."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = attn.wqkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)
    qk, v = qkv.split([H + Hkv, Hkv], dim=1)
    if attn.q_norm is not None:
        qk = attn.norm_qk(qk)
    if attn.use_rope and rope is not None:
        qk = apply_rope(qk, *rope).to(x.dtype)
    q, k = qk.split([H, Hkv], dim=1)
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    if window and T > window:
        i = torch.arange(T, device=x.device)
        visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=attn.scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.wo(out.transpose(1, 2).reshape(B, T, H * D))


def _check_head_tokens(ids: Tensor, vocab_size: int) -> Tensor:
    if ids.dim() != 1 or ids.numel() == 0:
        raise StagedSpecError("head tokens must be a non-empty 1-D list of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise StagedSpecError(f"head tokens must lie in 0..{vocab_size - 1}")
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        raise StagedSpecError("head tokens contain duplicates")
    return ids


# ---------------------------------------------------------------------- save (loading: `draft_loading.load_draft`)
INT8_GROUP = 32  # weights saved as int8: one scale per group of this many inputs, the native kernels' layout
INT8_SCALE_SUFFIX = ".int8_scale"  # the scales of an int8-saved weight `W` are stored as `W.int8_scale`


def int8_groups(w: Tensor) -> tuple[Tensor, Tensor]:
    """Codes [out, in] (int8) and scales [out, in / 32] (fp32) with w ≈ codes * scale, per group of 32 inputs.

    Symmetric, absmax / 127 per group: requantising the decoded weights gives
    back the same codes, so an int8-saved draft runs on the same integers it
    was saved as."""
    out_f, in_f = w.shape
    g = w.detach().float().reshape(out_f, in_f // INT8_GROUP, INT8_GROUP)
    scale = g.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    codes = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(out_f, in_f), scale


def decode_int8_groups(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The fp32 weights of an int8-saved draft (`int8_groups`); tensors without scales as they are."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(INT8_SCALE_SUFFIX):
            continue
        scale = tensors.get(name + INT8_SCALE_SUFFIX)
        if scale is None:
            out[name] = t
            continue
        if t.dtype != torch.int8 or t.dim() != 2 or tuple(scale.shape) != (t.shape[0], t.shape[1] // INT8_GROUP):
            raise StagedSpecError(f"int8 weight {name} of shape {tuple(t.shape)} does not match its scales "
                                  f"{tuple(scale.shape)}")
        g = t.float().reshape(t.shape[0], -1, INT8_GROUP) * scale.float()[..., None]
        out[name] = g.reshape(t.shape)
    return out


def _saved_tensors(model: DraftModel, dtype: torch.dtype | str) -> dict[str, Tensor]:
    """The draft's own tensors as written: floats cast to `dtype`, or int8 codes + scales for matrices whose
    width is a whole number of groups (`int8_groups`; norms and biases stay bf16)."""
    out: dict[str, Tensor] = {}
    for k, v in model.own_state_dict().items():
        v = v.detach().cpu()
        if not v.is_floating_point():
            out[k] = v.contiguous()
        elif dtype == "int8" and v.dim() == 2 and v.shape[1] % INT8_GROUP == 0:
            codes, scale = int8_groups(v)
            out[k], out[k + INT8_SCALE_SUFFIX] = codes.contiguous(), scale.to(torch.float16).contiguous()
        else:
            cast = torch.bfloat16 if dtype == "int8" else getattr(torch, dtype) if isinstance(dtype, str) else dtype
            out[k] = v.to(cast).contiguous()
    return out


def save_draft(
    model: DraftModel,
    folder: str | Path,
    fingerprint: str,
    meta: Mapping[str, Any] | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
) -> Path:
    """Write `draft_config.json` + `draft.safetensors` (own weights only, floats cast to `dtype`; "int8":
    matrices as int8 codes with a scale per group of 32, `int8_groups`).

    Each file is written to a temporary name and renamed, so an interrupted
    save never leaves a half-written draft that would load as corrupt.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _saved_tensors(model, dtype)
    kind = model.kind
    config = {
        "format": FORMAT,
        # A feature draft needs a reader that knows the kind: older ones (version 1) would misread it.
        "format_version": FORMAT_VERSION if kind == INDEPENDENT else FEATURE_FORMAT_VERSION,
        "kind": kind,
        "model_config": model.config.to_dict(),
        "oracle_layers": list(model.oracle_layers),
        # a feature draft that also reads the inputs of these oracle layers (`FeatureDraftModel.feature_taps`)
        **({"feature_taps": list(model.feature_taps)} if getattr(model, "feature_taps", ()) else {}),
        "vocab_size": model.config.vocab_size,
        "hidden_size": model.config.hidden_size,
        "head": ("oracle-rows" if model.head_from_oracle else "restricted") if model.head_tokens is not None
        else "shared",
        "head_size": int(model.head_weight.shape[0]),
        "fingerprint": fingerprint,
        "dtype": str(dtype).removeprefix("torch."),
        "training": dict(meta or {}),
    }
    tmp = folder / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    os.replace(tmp, folder / WEIGHTS_NAME)
    write_text_atomic(folder / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    return folder


def read_draft_config(folder: str | Path) -> dict[str, Any]:
    """Parse and sanity-check `draft_config.json` (StagedSpecError on any problem)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StagedSpecError(f"no draft folder at {folder}")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise StagedSpecError(f"{folder} is not a draft: {CONFIG_NAME} is missing")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StagedSpecError(f"corrupt draft config {path}: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise StagedSpecError(f"{path} is not a stagedspec draft config")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FEATURE_FORMAT_VERSION:
        raise StagedSpecError(
            f"draft {folder} has format version {version}; this stagedspec reads up to {FEATURE_FORMAT_VERSION} "
            "(upgrade it)"
        )
    kind = cfg.setdefault("kind", INDEPENDENT)
    if kind not in KINDS:
        raise StagedSpecError(f"draft {folder} is of unknown kind {kind!r} (this stagedspec knows {', '.join(KINDS)})")
    for key in ("model_config", "oracle_layers", "vocab_size", "hidden_size", "fingerprint"):
        if key not in cfg:
            raise StagedSpecError(f"corrupt draft config {path}: no {key!r}")
    return cfg
