"""The EAGLE-style feature draft: the oracle's last hidden state plus the next token, one or two layers.

An independent draft (`DraftModel`) has to rebuild from tokens alone what the
oracle already computed.  A feature draft starts from it instead: its input
at position t is

    fc(concat(f_{t-1}, e(x_t)))

where f_{t-1} is the oracle's final normalised hidden state at position t-1
(its verification pass computes it anyway) and e the oracle's token
embedding (shared, frozen).  One or two decoder layers follow (copies of the
oracle's *last* layers: their input is closest to what fc produces), then the
final norm and the head restricted to the top-V tokens, exactly as in
`DraftModel`.  The normalised output at t, f̂_t, lives in the same space as
the oracle's f_t (the head reads it), so deeper tree levels feed the draft its
own f̂ where no oracle feature exists yet (EAGLE-1/2).

The class is a `DraftModel` with an extra `fc` and an `embed_rows` that fuses the
features in, so it inherits the KV-cache forward, tree masks, the restricted
head, the save format and the training helpers.  Without `features` it runs
on zero features: a pass of the right cost, which is what timing code needs
(`decode_step_seconds`, the cost profiles of `--method auto`).

Training-time test (EAGLE-3): `unrolled_hidden` runs k steps on the draft's
own predicted features, each step's position t attending to the real-feature
entries up to its tree root and to its own chain of predicted ancestors,
which is exactly what a tree node at depth j sees at inference.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError
from stagedspec.models.draft import DraftModel
from stagedspec.models.transformer import Attention, Transformer, apply_rope

KIND = "feature"


def last_layers(n_oracle: int, n_draft: int) -> list[int]:
    """The oracle's last `n_draft` layers: they read a residual stream closest to the final features."""
    if not 1 <= n_draft <= n_oracle:
        raise StagedSpecError(f"a feature draft needs 1..{n_oracle} layers, got {n_draft}")
    return list(range(n_oracle - n_draft, n_oracle))


class FeatureDraftModel(DraftModel):
    """A `DraftModel` whose input is fc(oracle feature, token embedding) instead of the embedding alone."""

    kind = KIND

    def __init__(
        self,
        oracle: Transformer,
        layers: int | Sequence[int] = 1,
        head_tokens: Tensor | Sequence[int] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        mlp_width: int | None = None,
        head_from_oracle: bool = False,
        taps: Sequence[int] = (),
    ) -> None:
        if oracle.config.arch == "gemma3":
            # The unrolled training pass (`unrolled_hidden`) has no q/k norms, sandwich norms or window yet.
            raise StagedSpecError("feature drafts do not support Gemma-3 oracles yet (distill --kind independent)")
        picked = last_layers(oracle.config.n_layers, layers) if isinstance(layers, int) else [int(i) for i in layers]
        super().__init__(oracle, picked, head_tokens, dtype=dtype, device=device, mlp_width=mlp_width,
                         head_from_oracle=head_from_oracle)
        w = self.embed.weight
        H = self.config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True, device=w.device, dtype=w.dtype)
        with torch.no_grad():  # start as feature + embedding: both halves pass through, training reweighs them
            eye = torch.eye(H, device=w.device, dtype=w.dtype)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
            self.fc.bias.zero_()
        self.feature_taps = check_taps(taps, oracle.config.n_layers)
        # The taps' features (EAGLE-3's low and mid features) join the final one as f + tap_fc(taps): zero at
        # the start, so a draft that grows taps computes what it did, and zero for the rows whose features
        # are the draft's own predictions (they have no taps), as in training's unrolled steps.
        self.tap_fc = zero_tap_fc(len(self.feature_taps), H, w) if self.feature_taps else None

    @property
    def feature_width(self) -> int:
        """The width of one row of input features: H, or H per tap more (the oracle's `feature_taps`)."""
        return self.config.hidden_size * (1 + len(self.feature_taps))

    # ------------------------------------------------------------------ inference
    def embed_rows(self, tokens: Tensor, positions: Tensor,
               features: Tensor | None = None) -> tuple[Tensor, tuple | None, tuple | None]:
        x, rope, local_rope = super().embed_rows(tokens, positions)
        return self.fuse(x, features), rope, local_rope

    def fuse(self, embedded: Tensor, features: Tensor | None) -> Tensor:
        """fc(concat(f, embedded)), f = the final features + tap_fc(the taps' features); missing features count
        as zeros (a pass of the same cost).  Features [.., H] (a predicted feature: no taps) or
        [.., feature_width]."""
        H = embedded.shape[-1]
        f = torch.zeros_like(embedded) if features is None else features.to(embedded.dtype)
        if f.shape[:-1] != embedded.shape[:-1] or f.shape[-1] not in (H, self.feature_width):
            raise ValueError(f"features of shape {tuple(f.shape)} for embeddings of shape {tuple(embedded.shape)}")
        if self.tap_fc is not None:
            f = widen_features(f, self.feature_width)
            f = f[..., :H] + self.tap_fc(f[..., H:])
        return self.fc(torch.cat([f, embedded], dim=-1))

    # ------------------------------------------------------------------ training
    def hidden_train(self, tokens: Tensor, features: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """Normalised outputs [B, T, H] of a causal pass; `features[:, t]` is the oracle's f_{t-1} (zeros at t=0)."""
        return self.unrolled_hidden(tokens, features, 1)[0]

    def unrolled_hidden(self, tokens: Tensor, features: Tensor | None, steps: int) -> list[Tensor]:
        """The outputs of `steps` unrolled passes ("training-time test"), each [B, T, H], with autograd.

        Step 0 reads the oracle's features.  Step j >= 1 reads step j-1's
        outputs shifted by one position: its row t is the tree node at depth j
        whose root sits at t - j.  That row attends to step 0's keys at
        positions <= t - j (the real-feature context and the root) and to
        step i's key at t - j + i for i = 1..j (its predicted ancestors and
        itself).  Rows t < j have no real root; the loss ignores them.
        """
        B, T = tokens.shape
        if T > self.config.max_position:
            raise StagedSpecError(f"training sequences of {T} tokens exceed the context of {self.config.max_position}")
        positions = torch.arange(T, device=tokens.device)
        embedded, rope, _ = Transformer.embed_rows(self, tokens, positions)
        if rope is not None:
            rope = (rope[0].reshape(1, 1, T, -1), rope[1].reshape(1, 1, T, -1))
        feats = torch.zeros_like(embedded) if features is None else features.to(embedded.dtype)
        keys: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]  # per layer, per step: (k, v)
        outputs: list[Tensor] = []
        for j in range(steps):
            x = self.fuse(embedded, feats)
            for li, layer in enumerate(self.layers):
                q, k, v = _qkv(layer.attn, layer.attn_norm(x), rope)
                keys[li].append((k, v))
                x = x + _unrolled_attention(layer.attn, q, keys[li], j)
                x = x + layer.mlp(layer.mlp_norm(x))
            h = self.norm(x)
            outputs.append(h)
            feats = F.pad(h[:, :-1], (0, 0, 1, 0))  # row t of the next step reads this step's row t-1
        return outputs

    def num_bytes(self) -> int:
        """Bytes streamed per step: the layers, norm and head, plus the fusing fc (and the taps' fc)."""
        fusing = [*self.fc.parameters(), *(self.tap_fc.parameters() if self.tap_fc is not None else ())]
        return super().num_bytes() + sum(t.numel() * t.element_size() for t in fusing)


def widen_features(features: Tensor, width: int) -> Tensor:
    """Features [..., H] or [..., width] as [..., width]: a predicted feature (the draft's own output) has no
    taps, and its taps read as zeros, the same in decoding, staging and training."""
    extra = width - features.shape[-1]
    return features if extra == 0 else torch.cat([features, features.new_zeros(*features.shape[:-1], extra)], dim=-1)


def check_taps(taps: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """Tap layers as a sorted tuple: distinct, each 1..n_layers-1 (layer 0's input is the embedding, which
    the draft reads anyway)."""
    out = tuple(sorted(int(t) for t in taps))
    if len(set(out)) != len(out) or any(not 1 <= t < n_layers for t in out):
        raise StagedSpecError(f"feature taps must be distinct layers in 1..{n_layers - 1}, got {list(taps)}")
    return out


@contextlib.contextmanager
def oracle_taps(oracle: Transformer, taps: Sequence[int]) -> Iterator[None]:
    """Within: the oracle's passes that return hidden states append the inputs of layers `taps`
    (`ModelRuntime.feature_taps`), as a draft with those taps reads them; the setting before is restored."""
    saved = oracle.runtime.feature_taps
    oracle.runtime.feature_taps = tuple(taps)
    try:
        yield
    finally:
        oracle.runtime.feature_taps = saved


def with_taps(draft: FeatureDraftModel, oracle: Transformer, taps: Sequence[int]) -> FeatureDraftModel:
    """`draft` reading the inputs of the oracle's `taps` layers too, computing what it did until trained
    (`tap_fc` starts at zero): how `distill --feature-taps` grows a trained draft into an EAGLE-3-style one."""
    taps = check_taps(taps, oracle.config.n_layers)
    if draft.feature_taps == taps:
        return draft
    if draft.feature_taps:
        raise StagedSpecError(f"this feature draft already reads taps {list(draft.feature_taps)}, not {list(taps)}")
    draft.feature_taps = taps
    draft.tap_fc = zero_tap_fc(len(taps), draft.config.hidden_size, draft.embed.weight)
    return draft


def zero_tap_fc(n_taps: int, hidden: int, like: Tensor) -> nn.Linear:
    """The taps' fusing layer (n_taps * H -> H, no bias) at zero, on `like`'s device and dtype."""
    fc = nn.Linear(n_taps * hidden, hidden, bias=False, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        fc.weight.zero_()
    return fc


def feature_draft_from(draft: DraftModel, oracle: Transformer) -> FeatureDraftModel:
    """A feature draft that computes exactly what the independent `draft` computes, until training moves it.

    The layers, final norm and head are `draft`'s; fc's feature half starts
    at zero and its embedding half at the identity, so the oracle's features
    are read but ignored at step 0 and the unrolled levels equal the
    independent draft's tree levels.  Distillation (`distill --kind feature
    --init-from DRAFT`) then only has to learn what the features add, instead
    of relearning what the trained draft knows (a fresh feature draft starts
    at a held-out KL of about 20 nats; see docs/draft.md).
    """
    if type(draft) is not DraftModel:
        raise StagedSpecError("a feature draft can start only from an independent draft")
    p = draft.embed.weight
    fd = FeatureDraftModel(oracle, list(draft.oracle_layers), draft.head_tokens, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        for mine, theirs in zip(fd.layers, draft.layers):
            mine.load_state_dict(theirs.state_dict())
        fd.norm.load_state_dict(draft.norm.state_dict())
        if draft.head is not None:
            fd.head.weight.copy_(draft.head.weight)
        H = fd.config.hidden_size
        fd.fc.weight.zero_()
        fd.fc.weight[:, H:].copy_(torch.eye(H, device=p.device, dtype=p.dtype))
        fd.fc.bias.zero_()
    fd.training_meta = dict(draft.training_meta)
    fd.fingerprint = draft.fingerprint
    fd.converted_from_independent = True  # its fc then learns at its own rate (`distill.fc_lr_scale`)
    return fd.train(draft.training)


def _qkv(attn: Attention, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """Queries [B, H, T, D], keys and values [B, Hkv, T, D] of one attention layer (RoPE applied)."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.view(B, T, Hkv, D).transpose(1, 2)
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    if attn.use_rope and rope is not None:
        q = apply_rope(q, *rope).to(x.dtype)
        k = apply_rope(k, *rope).to(x.dtype)
    return q, k, v


def _unrolled_attention(attn: Attention, q: Tensor, kv: list[tuple[Tensor, Tensor]], j: int) -> Tensor:
    """Step j's attention over the keys of steps 0..j (see `FeatureDraftModel.unrolled_hidden`)."""
    B, H, T, D = q.shape
    Hkv = attn.n_kv_heads
    k = torch.cat([kv_i[0] for kv_i in kv], dim=2)
    v = torch.cat([kv_i[1] for kv_i in kv], dim=2)
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    if j == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    else:
        t = torch.arange(T, device=q.device)
        blocks = [t[None, :] <= t[:, None] - j]  # step 0: the real context up to the root
        blocks += [t[None, :] == t[:, None] - j + i for i in range(1, j + 1)]  # step i: the ancestor at depth i
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat(blocks, dim=1), scale=attn.scale)
    return attn.wo(out.transpose(1, 2).reshape(B, T, H * D))


def is_feature_draft(model: object) -> bool:
    """Whether `model` needs the oracle's hidden states as input (a `FeatureDraftModel`)."""
    return isinstance(model, FeatureDraftModel)
