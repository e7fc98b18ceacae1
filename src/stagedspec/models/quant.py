"""Weight-only quantised linear layers (int4 group-wise, int8 per-channel) on PyTorch's CPU kernels.

Why: at batch size 1 a decoding step streams every weight once, so bytes per
weight set the speed.  The embedded default model ships as a Q4_1 GGUF: its
layers *are* 4-bit numbers in groups of 32, each group with a scale and an
offset.  Running them as 4-bit codes (instead of dequantised bf16) reads a
quarter of the bytes.  PyTorch has fused CPU kernels for exactly this shape
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`); measured on this
project's 2-core CPU they run the SmolLM2-135M layers in 2.6 ms per row
instead of 9.6 ms in bf16.

Two properties matter for speculation, and the tests check both:

- each output row depends only on its own input row (no rounding that varies
  with how many rows share the matmul), so a tree's verification computes
  the same numbers as one-token decoding;
- the int4 codes of a Q4_1 source are recovered exactly: Q4_1 quantises a
  group with offset = min and scale = (max - min) / 15, and re-quantising the
  dequantised values by min/max finds the same codes.  Only the group's
  scale and offset are rounded to bf16, the kernel's format.

Activations stay bf16 (the kernels' fast path).  The layers have no fp32
mode: fp32 exists for reference tests, which compare against unquantised
weights anyway.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError

QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP = 32  # Q4_1's block size; also the finest group the CPU kernel takes
_INNER_K_TILES = 2  # packing parameter of the CPU int4 kernel (2 suits K = 576 and 1536)


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with W stored as 4-bit codes q in groups of `INT4_GROUP` along the input axis.

    Dequantised value: (q - 8) * scale + zero, per (group, output row).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise StagedSpecError(f"int4 needs input sizes divisible by {INT4_GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        codes, scale, zero = quantize_int4(weight.float())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES))
        # [groups, out, 2] as the kernel wants it
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features), self.packed, INT4_GROUP, self.scales_zeros
        )
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The weight [out, in] this layer multiplies by, in fp32 (for tests and diagnostics)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, self.scales_zeros).float().t()


class Int8Linear(nn.Module):
    """y = x Wᵀ (+ b) with W stored as int8 and one scale per output row (symmetric)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        scale = scale.to(torch.bfloat16)
        codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.codes, self.scale)
        y = y.view(*lead, y.shape[-1])
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        return self.codes.float() * self.scale.float()[:, None]


class RowSwitchLinear(nn.Module):
    """int8 weights for passes of at most `max_rows` rows, the dense weights for bigger ones.

    Why: the int8 kernel streams half of bf16's bytes and wins where a pass
    is a few rows, but it is not blocked for many rows.  On the AMX CPU a
    draft's 1-row pass costs 0.52x its bf16 time and a 4-row pass 0.72x, but
    16 rows cost 1.6x and 48 rows 2.7x (session 14).  A draft's decoding
    passes are a few rows; its prompt pass is a whole prompt.  Both weights
    are kept; the dense one is a plain attribute, not counted as streamed.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, max_rows: int) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.q = Int8Linear(weight, bias)
        self.dense_weight = weight.detach()
        self.dense_bias = None if bias is None else bias.detach()
        self.max_rows = max_rows

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() <= self.max_rows * self.in_features:
            return self.q(x)
        return nn.functional.linear(x, self.dense_weight, self.dense_bias)


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Codes [out, in] (int32 in 0..15), scale and zero [out, groups] (fp32, already bf16-representable).

    Min/max per group, the way Q4_1 is made; the codes are then chosen
    against the bf16-rounded scale and zero, the values the kernel will use.
    """
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    zero = lo + 8.0 * scale
    scale, zero = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
    codes = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    codes = codes.clamp_(0, 15).to(torch.int32).reshape(out_f, in_f)
    return codes, scale, zero


def check_quant(mode: str, dtype: torch.dtype, device: str) -> None:
    """A clear error for combinations the kernels do not run."""
    if mode not in QUANT_MODES:
        raise StagedSpecError(f"unknown quantisation {mode!r}: use one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return
    if not str(device).startswith("cpu"):
        raise StagedSpecError(f"--quant {mode} runs on PyTorch's CPU kernels only; on {device} use --quant none")
    if dtype != torch.bfloat16:
        raise StagedSpecError(f"--quant {mode} computes in bf16; use --dtype bf16 (fp32 is for reference runs)")


def _swap_layers(module: nn.Module, kind: type | tuple[type, ...], make: Callable[[nn.Module], nn.Module]) -> None:
    """Replace every submodule of type `kind` under `module` by `make(it)`, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, kind):
            setattr(module, name, make(child))
        else:
            _swap_layers(child, kind, make)


def quantize_linears(module: nn.Module, mode: str) -> None:
    """Replace every `nn.Linear` under `module` by its `mode` counterpart, in place."""
    make = {"int4": Int4Linear, "int8": Int8Linear}[mode]
    _swap_layers(module, nn.Linear, lambda linear: make(linear.weight.detach(), linear.bias))


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Quantise a `Transformer`'s layers (int4 or int8) and its output head (int8), in place.

    Give it full-precision (fp32) weights: quantising values that were
    already rounded to bf16 would move a Q4_1 group's min and max.  Every
    other tensor (embedding, norms, biases) is cast to `dtype` afterwards.
    The int8 head keeps the 49k-row vocabulary projection at a byte per
    weight; the embedding table itself stays in `dtype`, since a lookup reads
    only one row per token.
    """
    if mode == "none":
        return model.to(dtype)
    for layer in model.layers:
        quantize_linears(layer, mode)
    model.head_q = Int8Linear(model.head_weight.detach(), None)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def dequantized_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` with every quantised linear layer turned back into an `nn.Linear`.

    Drafts copy oracle layers as their starting point and own float weights
    (they are trained and saved as such), whatever the oracle runs on.
    """
    module = copy.deepcopy(module)
    _swap_layers(module, (Int4Linear, Int8Linear), _as_linear)
    return module


def _as_linear(layer: Int4Linear | Int8Linear) -> nn.Linear:
    weight = layer.dequantized()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear


def quantize_draft(draft: nn.Module, oracle: nn.Module) -> nn.Module:
    """int8 layers and head for a draft that proposes to a quantised oracle, in place.

    Why: once the oracle runs on int4, a bf16 draft pass costs relatively
    twice as much as before; int8 draft weights cut it without changing what
    the draft proposes in any way that matters (measured: same mean accepted
    length, `staged` 1.29x instead of 1.22x int4 `ar`).  Exactness never
    depends on the draft.  Layers shared with the oracle (a `layers:N`
    draft) are already quantised and are left as they are.
    """
    for layer in draft.layers:
        quantize_linears(layer, "int8")
    own_head = getattr(draft, "head", None)
    if own_head is not None:  # a distilled draft's restricted head
        draft.head_q = Int8Linear(own_head.weight.detach(), None)
    elif draft.head_weight is oracle.head_weight:  # the oracle's own (tied) head
        draft.head_q = oracle.head_q
    return draft
