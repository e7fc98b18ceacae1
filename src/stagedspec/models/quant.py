"""Weight-only quantised linear layers (int4 and int8 in groups of 32) for the CPU.

Why: at batch size 1 a decoding step streams every weight once, so bytes per
weight set the speed.  The embedded default model ships as a Q4_1 GGUF: its
layers *are* 4-bit numbers in groups of 32, each group with a scale and an
offset.  Running them as 4-bit codes reads about a quarter of bf16's bytes.

Two kernel backends, chosen once per process (`kernels=`):

- **native** (the default where it builds): `stagedspec.kernels`, C++ with
  AVX2 / AVX-512 VNNI integer dot products.  Weights: int4 codes with an fp16
  scale and low per group of 32 (weight = scale * code + low), or int8 codes
  with an fp16 scale per group of 32.  Activations are quantised to int8 per
  row and group inside the kernel.  Every row's result is bit-identical
  whatever shares its pass, and the same on every instruction set.  Runs with
  bf16 or fp32 activations.
- **torch** (the fallback, `STAGEDSPEC_QKERNELS=torch`, or where the native
  build fails): PyTorch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`,
  bf16 activations only; int4 scales rounded to bf16, int8 one scale per row.

Under "mixed" (what `--quant auto` picks for a GGUF) each layer keeps its
file's numbers exactly where a native format holds them: Q4_K, Q6_K and Q5_0
run as themselves (`q4_k`, `q6_k`, `q5_0`: their stored codes and scales,
read from the file's blocks by `stagedspec.models.gguf_codes`); Q4_0 and Q4_1
as int4, and Q8_0 as int8, recovered from the dequantised values (their codes
sit on a grid with fp16 scales, which the grid scan finds exactly).  A fused
layer (q|k|v, gate|up) keeps each part's format as a segment.  Other types
(Q5_K, F16) are re-quantised: int4 where most groups sit on a 4-bit grid,
else int8 by Q8_0's rule.  `int4` and `int8` re-quantise every layer to that
one format.  Exactness of speculation is always with respect to the quantised
model that results.
"""

from __future__ import annotations

import copy
import json
from typing import Callable

import torch
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError
from stagedspec.kernels import grid, packing
from stagedspec.kernels.native import NativeKernels, native_kernels
from stagedspec.models.gguf_codes import KEPT_TYPES, RawTensor, q4k_codes, q5_0_codes, q6k_codes
from stagedspec.models.gguf_file import read_tensor_table
from stagedspec.models.specs import resolve_model_path
from stagedspec.models.transformer import Attention, Block, RMSNorm, Transformer

# "mixed": each layer in its source's own format where a GGUF's blocks are at hand (see above); otherwise int4
# where most of its groups are 4-bit in the source (a Q4_0/Q4_1/Q4_K tensor), int8 elsewhere (Q5_0, Q6_K,
# Q8_0), as llama.cpp keeps them.  `--quant auto` picks it for a quantised source (a GGUF, or a folder
# converted from one) on a CPU, and "none" otherwise.
QUANT_MODES = ("none", "int8", "int4", "mixed")
QUANT_CHOICES = ("auto", *QUANT_MODES)
MIXED_INT4_SHARE = 0.5  # a layer runs int4 under "mixed" when at least this share of its groups is 4-bit
INT4_GROUP = 32  # Q4_1's block size; also the finest group the CPU kernel takes
_INNER_K_TILES = 2  # packing parameter of the CPU int4 kernel (2 suits K = 576 and 1536)
KERNEL_CHOICES = ("auto", "native", "torch")


def resolve_kernels(choice: str | NativeKernels | None = "auto") -> NativeKernels | None:
    """The native kernels for `choice` ("auto": native where they build, else PyTorch's), None for PyTorch's."""
    if choice is None or isinstance(choice, NativeKernels):
        return choice
    if choice not in KERNEL_CHOICES:
        raise StagedSpecError(f"unknown kernel choice {choice!r}: use one of {', '.join(KERNEL_CHOICES)}")
    if choice == "torch":
        return None
    kernels = native_kernels()
    if kernels is None and choice == "native":
        raise StagedSpecError("the native int4/int8 kernels are not available on this machine (see the line above)")
    return kernels


def weight_format(layer: nn.Module) -> str | None:
    """"int4", "int8", "q4_k", "q6_k", or parts joined by "+" ("q4_k+q6_k"); None for an unquantised layer."""
    if isinstance(layer, Int4Linear):
        return "int4"
    if isinstance(layer, Int8Linear):
        return "int8"
    if isinstance(layer, SegmentLinear):
        return "+".join(dict.fromkeys(layer.format_names))
    return None


def describe_weights(model: Transformer) -> str:
    """E.g. "int4 x 196, int8 x 29 layers + int8 head, on stagedspec-native (AVX2)", or "unquantised"."""
    counts: dict[str, int] = {}
    head_q = model.head_q
    for m in model.modules():
        kind = weight_format(m)
        if kind is not None and m is not head_q:
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return "unquantised"
    layers = ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
    head_kind = weight_format(head_q) if head_q is not None else None
    head = f" + {head_kind} head" if head_kind else ""
    return f"{layers} layers{head}, on {kernel_name(model)}"


def row_exact(model: Transformer) -> bool:
    """Whether every matrix product of `model`'s passes gives a row the same bits whatever else shares the pass.

    True when all its linear layers and its vocabulary head run on the native kernels, which compute each row
    alone (tested: `tests/test_kernels.py`); its attention and norms are per row or per request already.  A
    dense layer (bf16, fp32 with its row-count plan, cuBLAS) or a quantised one on PyTorch's kernels rounds a
    row by the pass's shape, so batching it with other requests' rows can move its last bits.
    """
    native = (Int4Linear, Int8Linear, SegmentLinear)
    if model.head_q is None:
        return False
    replaced = {id(getattr(model, name)) for name in ("head", "lm_head") if getattr(model, name, None) is not None}
    for m in model.modules():
        if id(m) in replaced:  # a dense head that `head_q` stands in for is never run
            continue
        if isinstance(m, native):
            if m.kernels is None:
                return False
        elif isinstance(m, (nn.Linear, RowSwitchLinear)):
            return False
    return True


def kernel_name(module: nn.Module) -> str:
    """Which kernel runs `module`'s quantised layers: 'stagedspec-native (AVX2)', 'torch', or 'none'."""
    for m in module.modules():
        if isinstance(m, (Int4Linear, Int8Linear, SegmentLinear)):
            return m.kernels.name if m.kernels is not None else "torch"
    return "none"


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with W stored as 4-bit codes in groups of `INT4_GROUP` along the input axis."""

    def __init__(self, weight: Tensor, bias: Tensor | None, kernels: str | NativeKernels | None = "auto") -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise StagedSpecError(f"int4 needs input sizes divisible by {INT4_GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.kernels = resolve_kernels(kernels)
        if self.kernels is not None:
            codes, scale, low = grid.int4_groups_from_float(weight)
            self.register_buffer("packed", packing.pack_int4(codes, scale, low))
        else:
            codes, scale, zero = quantize_int4(weight.float())
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES))
            # [groups, out, 2] as the kernel wants it
            self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.kernels is not None:
            y = self.kernels.q4_linear(flat, self.packed, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_zeros)
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The weight [out, in] this layer multiplies by, in fp32 (for tests and diagnostics)."""
        if self.kernels is not None:
            return packing.unpack_int4(self.packed, self.out_features, self.in_features)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, self.scales_zeros).float().t()


class Int8Linear(nn.Module):
    """y = x Wᵀ (+ b) with W stored as int8: native, one scale per group of 32; torch, one per output row."""

    def __init__(self, weight: Tensor, bias: Tensor | None, kernels: str | NativeKernels | None = "auto") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernels = resolve_kernels(kernels)
        if self.in_features % INT4_GROUP:
            self.kernels = None  # the native layout needs whole groups of 32
        w = weight.float()
        if self.kernels is not None:
            codes, scale = grid.int8_groups_from_float(w)
            self.register_buffer("packed", packing.pack_int8(codes, scale))
        else:
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            scale = scale.to(torch.bfloat16)
            codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
            self.register_buffer("codes", codes)
            self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.kernels is not None:
            y = self.kernels.q8_linear(flat, self.packed, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        y = y.view(*lead, y.shape[-1])
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        if self.kernels is not None:
            return packing.unpack_int8(self.packed, self.out_features, self.in_features)
        return self.codes.float() * self.scale.float()[:, None]


class SegmentLinear(nn.Module):
    """y = x Wᵀ (+ b) with W's outputs stored as segments, each in its source's own format (native kernels only).

    Why: a GGUF stores Q4_K and Q6_K weights as codes and scales that the
    native kernels run as they are (exactly the file's weights, at the file's
    size), and a fused layer's parts (q|k|v, gate|up) may differ in type.
    One kernel call runs all segments with activations quantised once.
    """

    def __init__(self, parts: list[tuple[str, Tensor, int]], in_features: int, bias: Tensor | None,
                 kernels: NativeKernels) -> None:
        super().__init__()
        self.in_features = in_features
        self.format_names = [fmt for fmt, _, _ in parts]
        self.formats = [packing.FORMATS[fmt] for fmt in self.format_names]
        self.outs = [n for _, _, n in parts]
        self.out_features = sum(self.outs)
        self.kernels = kernels
        self.register_buffer("packed", torch.cat([p for _, p, _ in parts]).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = self.kernels.qlinear(x.reshape(-1, self.in_features), self.packed, self.formats, self.outs)
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The weight [out, in] this layer multiplies by, in fp32 (for tests and diagnostics)."""
        return packing.unpack_segments(self.packed, self.formats, self.outs, self.in_features)


class NativeDecoderLayer:
    """A Llama-family `Block` run as one native call (`NativeKernels.decoder_layer`), its arguments gathered once.

    Why: at one row, Python's cost per operation (about 25 a layer) is as
    much as the weights' streaming on a 135M model; the native call runs the
    same operations in the same order, so the bits do not change.
    """

    def __init__(self, block: nn.Module, kernels: NativeKernels) -> None:
        attn, mlp = block.attn, block.mlp
        linears = [attn.wqkv, attn.wo, mlp.w_up, mlp.w_down]
        segments = [_segments(layer) for layer in linears]
        self.kernels = kernels
        self.packed = [layer.packed for layer in linears]
        self.formats = [f for fmts, _ in segments for f in fmts]
        self.outs = [n for _, outs in segments for n in outs]
        self.splits = [len(fmts) for fmts, _ in segments]
        self.biases = [layer.bias for layer in linears]
        self.attn_norm, self.mlp_norm, self.eps = block.attn_norm.weight, block.mlp_norm.weight, block.attn_norm.eps
        self.scale = attn.scale or attn.head_dim ** -0.5
        self.n_heads, self.n_kv_heads = attn.n_heads, attn.n_kv_heads

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], k_cache: Tensor, v_cache: Tensor, start: int,
                 mask: Tensor | None) -> Tensor:
        cos, sin = rope
        return self.kernels.decoder_layer(x, self.packed, self.formats, self.outs, self.splits, self.biases,
                                          self.attn_norm, self.mlp_norm, self.eps, cos, sin, k_cache, v_cache, start,
                                          mask, self.scale, self.n_heads, self.n_kv_heads)


class NativeLayerStack:
    """Every block of a model run as one native call (`NativeKernels.decoder_layers`), the blocks' arguments
    gathered once: the same operations and bits as one `NativeDecoderLayer` call per block.

    Why: a call per block cost about 50-70 us of Python argument boxing and dispatch (measured on an AMD EPYC,
    Zen 3, AVX2, 2 threads: SmolLM2-135M's 30 layers at one row), beside a 12 ms pass.
    """

    def __init__(self, layers: list[NativeDecoderLayer]) -> None:
        first = layers[0]
        self.blocks = layers
        self._parts: dict[tuple[int, int], NativeLayerStack] = {}
        self.kernels = first.kernels
        self.packed = [p for layer in layers for p in layer.packed]
        self.formats = [f for layer in layers for f in layer.formats]
        self.outs = [n for layer in layers for n in layer.outs]
        self.splits = [n for layer in layers for n in layer.splits]
        self.biases = [b for layer in layers for b in layer.biases]
        self.attn_norms = [layer.attn_norm for layer in layers]
        self.mlp_norms = [layer.mlp_norm for layer in layers]
        self.eps, self.scale = first.eps, first.scale
        self.n_heads, self.n_kv_heads = first.n_heads, first.n_kv_heads

    @classmethod
    def of(cls, blocks: list[nn.Module]) -> NativeLayerStack | None:
        """The stack of `blocks` where every one runs as a `NativeDecoderLayer` with the same shared settings."""
        layers = [b.native_layer for b in blocks]
        if not layers or not all(isinstance(layer, NativeDecoderLayer) for layer in layers):
            return None
        shared = {(layer.eps, layer.scale, layer.n_heads, layer.n_kv_heads, layer.kernels.isa) for layer in layers}
        return cls(layers) if len(shared) == 1 else None

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], k_caches: Tensor, v_caches: Tensor, start: int,
                 mask: Tensor | None) -> Tensor:
        """x [B, T, hidden] through every block; k_caches / v_caches [layers, B, Hkv, S, D]."""
        cos, sin = rope
        return self.kernels.decoder_layers(x, self.packed, self.formats, self.outs, self.splits, self.biases,
                                           self.attn_norms, self.mlp_norms, self.eps, cos, sin, k_caches, v_caches,
                                           start, mask, self.scale, self.n_heads, self.n_kv_heads)


    def part(self, lo: int, hi: int) -> NativeLayerStack:
        """The stack of blocks lo..hi-1 (built once): a pass that keeps a block's input (`feature_taps`) runs
        the stack in parts; each part's caches are the matching slice of the layers' caches."""
        if (lo, hi) not in self._parts:
            self._parts[lo, hi] = NativeLayerStack(self.blocks[lo:hi])
        return self._parts[lo, hi]

    def ragged(self, x: Tensor, rope: tuple[Tensor, Tensor], k_caches: list[Tensor], v_caches: list[Tensor],
               starts: list[int], rows: list[int], masks: list[Tensor | None]) -> Tensor:
        """x [1, R, hidden] holding several requests' rows (`stagedspec.models.ragged`) through every block;
        request i has rows[i] rows, caches [layers, 1, Hkv, S, D] and its slots from starts[i]."""
        cos, sin = rope
        return self.kernels.ragged_layers(x, self.packed, self.formats, self.outs, self.splits, self.biases,
                                          self.attn_norms, self.mlp_norms, self.eps, cos, sin, k_caches, v_caches,
                                          starts, rows, masks, self.scale, self.n_heads, self.n_kv_heads)


def _segments(layer: nn.Module) -> tuple[list[int], list[int]]:
    if isinstance(layer, SegmentLinear):
        return layer.formats, layer.outs
    fmt = "int4" if isinstance(layer, Int4Linear) else "int8"
    return [packing.FORMATS[fmt]], [layer.out_features]


def fusable(block: nn.Module) -> bool:
    """Whether `block` is a Llama-family block whose parts all run on the native kernels (see `NativeDecoderLayer`)."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if attn is None or mlp is None or getattr(block, "post_attn_norm", None) is not None:
        return False
    linears = [attn.wqkv, attn.wo, mlp.w_up, mlp.w_down]
    return (attn.use_rope and attn.q_norm is None and attn.native_attention is not None and mlp.gated
            and not mlp.gelu_gate and isinstance(block.attn_norm, NativeRMSNorm)
            and isinstance(block.mlp_norm, NativeRMSNorm)
            and all(isinstance(layer, (Int4Linear, Int8Linear, SegmentLinear)) and layer.kernels is not None
                    for layer in linears))


def source_segment(weight: Tensor, raw: RawTensor | None) -> tuple[str, Tensor, int]:
    """One part of a layer in its source's format: Q4_K / Q6_K / Q5_0 from the stored blocks, else int4 or int8
    from the fp32 values (exact for Q4_0, Q4_1 and Q8_0, whose codes sit on the grid the scan finds)."""
    n = weight.shape[0]
    if raw is not None and raw.kind == "Q4_K":
        return "q4_k", packing.pack_q4k(*q4k_codes(raw)), n
    if raw is not None and raw.kind == "Q6_K":
        return "q6_k", packing.pack_q6k(*q6k_codes(raw)), n
    if raw is not None and raw.kind == "Q5_0":
        return "q5_0", packing.pack_q5(*q5_0_codes(raw)), n
    if layer_format(weight) == "int4":
        return "int4", packing.pack_int4(*grid.int4_groups_from_float(weight)), n
    return "int8", packing.pack_int8(*grid.int8_groups_from_float(weight)), n


def from_source(weight: Tensor, bias: Tensor | None, raws: list[RawTensor], kernels: NativeKernels) -> nn.Module:
    """A layer in its GGUF parts' own formats: a `SegmentLinear`, or the plain int4 / int8 layer where every
    part comes out in that one format."""
    rows = [r.blocks.shape[0] for r in raws]
    if sum(rows) != weight.shape[0] or any(r.kind in ("Q4_K", "Q6_K") and weight.shape[1] % packing.SUPER for r in raws):
        raise StagedSpecError(f"GGUF parts of {rows} rows do not match a weight of shape {tuple(weight.shape)}")
    parts = [source_segment(w, r) for w, r in zip(weight.float().split(rows), raws)]
    kinds = {fmt for fmt, _, _ in parts}
    if kinds == {"int4"}:
        return Int4Linear(weight, bias, kernels)
    if kinds == {"int8"}:
        return Int8Linear(weight, bias, kernels)
    return SegmentLinear(parts, weight.shape[1], bias, kernels)


class NativeRMSNorm(nn.Module):
    """RMSNorm on the native kernels (one call instead of PyTorch's chain of small fp32 ops), for quantised models."""

    def __init__(self, norm: nn.Module, kernels: NativeKernels) -> None:
        super().__init__()
        self.eps, self.kernels = norm.eps, kernels
        self.weight = norm.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class RowSwitchLinear(nn.Module):
    """int8 weights for passes of at most `max_rows` rows, the dense weights for bigger ones.

    Why: the int8 kernel streams half of bf16's bytes and wins where a pass
    is a few rows, but it is not blocked for many rows: on an AMX CPU it beat
    bf16 at a draft's few rows and lost at many
    (docs/measurements.md, "int8 against bf16 weights by row count on an AMX Xeon").  A draft's decoding
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
        raise StagedSpecError(f"--quant {mode} runs on CPU kernels only; on {device} use --quant none")
    if dtype not in (torch.bfloat16, torch.float32):
        raise StagedSpecError(f"--quant {mode} takes bf16 or fp32 activations, not {dtype}")
    if dtype == torch.float32 and native_kernels() is None:
        raise StagedSpecError(f"--quant {mode} with fp32 activations needs the native kernels; "
                              "PyTorch's fallback computes in bf16: use --dtype bf16")


def swap_layers(module: nn.Module, kind: type | tuple[type, ...], make: Callable[[nn.Module], nn.Module]) -> None:
    """Replace every submodule of type `kind` under `module` by `make(it)`, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, kind):
            setattr(module, name, make(child))
        else:
            swap_layers(child, kind, make)


def quantize_linears(module: nn.Module, mode: str, kernels: str | NativeKernels | None = "auto",
                     sources: dict[str, list[RawTensor]] | None = None, prefix: str = "") -> None:
    """Replace every `nn.Linear` under `module` by its `mode` counterpart, in place.

    `sources` (`loading.gguf_sources`, keyed by `prefix` + the layer's name under `module`): under "mixed"
    with the native kernels, a layer found there keeps its GGUF parts' own formats (`from_source`).
    """
    kernels = resolve_kernels(kernels)
    sources = sources or {}
    for name, child in list(module.named_children()):
        if not isinstance(child, nn.Linear):
            quantize_linears(child, mode, kernels, sources, f"{prefix}{name}.")
            continue
        w = child.weight.detach()
        raws = sources.get(prefix + name)
        if mode == "mixed" and kernels is not None and raws:
            layer = from_source(w, child.bias, raws, kernels)
        else:
            layer_mode = mode if mode != "mixed" else layer_format(w)
            layer = (Int4Linear if layer_mode == "int4" else Int8Linear)(w, child.bias, kernels)
        setattr(module, name, layer)


def layer_format(weight: Tensor) -> str:
    """"int4" where most of the weight's groups of 32 sit on a 4-bit grid (a 4-bit source), else "int8"."""
    if weight.shape[1] % INT4_GROUP:
        return "int8"
    return "int4" if grid.four_bit_share(weight) >= MIXED_INT4_SHARE else "int8"


def resolve_quant(choice: str, spec: object, device: str) -> str:
    """The quantisation mode for a `--quant` value: "auto" is "mixed" for a quantised source on a CPU, else "none".

    Why: a GGUF user expects its 4-bit weights to run as 4-bit (llama.cpp
    does), and those are the fastest weights here; an HF checkpoint in bf16
    or fp32 stays as it is unless a mode is named.
    """
    if choice != "auto":
        return choice
    if not str(device).startswith("cpu"):
        return "none"
    return "mixed" if source_is_quantised(spec) else "none"


def source_is_quantised(spec: object) -> bool:
    """Whether a model spec's weights come from a quantised GGUF (read from the header's tensor table only)."""
    path = resolve_model_path(str(spec))
    if path.is_dir():
        try:
            stamp = json.loads((path / "stagedspec.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return str(stamp.get("source", "")).lower().endswith(".gguf")
    plain = {"F32", "F16", "BF16", "F64"}
    return any(t.type_name not in plain for t in read_tensor_table(path) if len(t.shape) == 2)


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype = torch.bfloat16,
                   kernels: str | NativeKernels | None = "auto",
                   sources: dict[str, list[RawTensor]] | None = None) -> nn.Module:
    """Quantise a `Transformer`'s layers (int4, int8, or "mixed") and its output head (int8), in place.

    `sources` (a GGUF's stored blocks per layer, `loading.gguf_sources`) let "mixed" keep the file's
    K-quant layers and head in their own formats.

    Give it full-precision (fp32) weights: quantising values that were
    already rounded to bf16 would move a Q4_1 group's min and max.  Every
    other tensor (embedding, norms, biases) is cast to `dtype` afterwards.
    The int8 head keeps the 49k-row vocabulary projection at a byte per
    weight; the embedding table itself stays in `dtype`, since a lookup reads
    only one row per token.
    """
    if mode == "none":
        return model.to(dtype)
    kernels = resolve_kernels(kernels)
    sources = sources or {}
    for i, layer in enumerate(model.layers):
        quantize_linears(layer, mode, kernels, sources, f"layers.{i}.")
    head_raws = sources.get("head")
    if mode == "mixed" and kernels is not None and head_raws and head_raws[0].kind in KEPT_TYPES:
        model.head_q = from_source(model.head_weight.detach(), None, head_raws, kernels)
    else:
        model.head_q = Int8Linear(model.head_weight.detach(), None, kernels)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if kernels is not None:
        run_rest_natively(model, kernels)
    return model


def run_rest_natively(model: nn.Module, kernels: NativeKernels) -> None:
    """Norms and attention on the native kernels (each row computed alone), and eligible blocks as one native
    call each (`NativeDecoderLayer`), all of them as one call where every block is eligible (`NativeLayerStack`),
    for a model whose linear layers already run on them.  In place."""
    swap_layers(model, RMSNorm, lambda norm: NativeRMSNorm(norm, kernels))
    for m in model.modules():
        if isinstance(m, Attention):
            m.native_attention = kernels
    for block in model.layers:
        block.native_layer = NativeDecoderLayer(block, kernels) if fusable(block) else None
    model.runtime.native_stack = NativeLayerStack.of(list(model.layers))


def dequantized_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` with every quantised linear layer turned back into an `nn.Linear`.

    Drafts copy oracle layers as their starting point and own float weights
    (they are trained and saved as such), whatever the oracle runs on.
    """
    if isinstance(module, NativeRMSNorm):
        return _as_rms_norm(copy.deepcopy(module), RMSNorm)
    module = copy.deepcopy(module)
    swap_layers(module, (Int4Linear, Int8Linear, SegmentLinear), _as_linear)
    # The native norm and attention kernels have no backward: a copy that is trained must run PyTorch's
    # (on a quantised teacher, gradients through a native norm were silently wrong)
    swap_layers(module, NativeRMSNorm, lambda norm: _as_rms_norm(norm, RMSNorm))
    for m in module.modules():
        if isinstance(m, Attention):
            m.native_attention = None
        if isinstance(m, Block) and m.native_layer is not None:
            m.native_layer = None  # it would still run the quantised copies
        if isinstance(m, Transformer):  # a whole model: its stack would run the quantised blocks
            m.runtime.native_stack = None
    return module


def _as_rms_norm(norm: "NativeRMSNorm", cls: type) -> nn.Module:
    plain = cls(norm.weight.shape[0], norm.eps)
    plain.weight = norm.weight
    return plain


def _as_linear(layer: Int4Linear | Int8Linear | SegmentLinear) -> nn.Linear:
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
    kernels = resolve_kernels("auto")
    for layer in draft.layers:
        quantize_linears(layer, "int8", kernels)
    fc = getattr(draft, "fc", None)
    if isinstance(fc, nn.Linear):  # a feature draft's fusing layer: 2H x H weights streamed every pass
        draft.fc = Int8Linear(fc.weight.detach(), fc.bias, kernels)
    own_head = getattr(draft, "head", None)
    if own_head is not None and getattr(draft, "head_from_oracle", False) and kernels is not None:
        # Rows of the oracle's own head (a feature draft's, `--head-from-oracle`): the largest part of the draft's
        # pass (Qwen2.5-Coder-1.5B's: 24,576 x 1,536, 60% of its int8 bytes), and the draft's proposals barely
        # move with their rounding, so int4: on a Zen 5 EPYC a fan of 3 accepted the same 1.5 tokens a step and
        # its draft took 0.25-0.29 ms less a step (docs/measurements.md, "The Qwen feature draft's head in int4").
        draft.head_q = Int4Linear(own_head.weight.detach(), None, kernels)
    elif own_head is not None:  # a distilled draft's restricted head
        draft.head_q = Int8Linear(own_head.weight.detach(), None, kernels)
    elif draft.head_weight is oracle.head_weight:  # the oracle's own (tied) head
        draft.head_q = oracle.head_q
    if kernels is not None:  # norms, attention and whole blocks native too: a draft pass is mostly overhead
        run_rest_natively(draft, kernels)
    return draft
