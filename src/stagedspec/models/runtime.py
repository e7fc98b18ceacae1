"""What a loaded model runs with beside its weights and config (`ModelRuntime`).

Why apart: a model's passes depend on choices made for this machine after its weights are read (the runner
pool and pass options, the C++ decoder stack, the fp32 matmul plan, the draft weights' format).  Kept as loose
attributes of the `nn.Module`, set from several modules and read through `getattr` probes, they were the
module's hidden state.  Here they are one declared record, `Transformer.runtime`, that the loaders and the
kernels' setup fill in and the passes read.

The quantised head (`Transformer.head_q`) stays a submodule: it is weights, which `.to()`, `parameters()` and
the memory accounting must see.  The per-layer kernels (`Attention.native_attention`, `Block.native_layer`)
stay with their layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from stagedspec.pass_options import PassRuntime


@dataclass(eq=False)
class ModelRuntime:
    """One model's run-time state.

    - `passes`: how the runner runs the model's passes, with its pool of runners (`stagedspec.runner`): the
      environment's defaults until a loader gives the options a command chose (`load_model(pass_options=...)`).
    - `native_stack`: every decoder block as one C++ call (`models.quant.NativeLayerStack`, the same bits as a
      call per block), set by `models.quant.run_rest_natively` where every block runs natively; None otherwise.
    - `head_row_plan`: which kernel and padded row count the output head runs per row count
      (`models.matmul_plan`); None: `F.linear`.
    - `matmul_plan_signature`: which kernel runs which fp32 passes, hashed (`models.matmul_plan.plan_matmuls`;
      part of the cost-profile key); None: not planned.
    - `weight_format`, `weight_reason`: the format a draft's weights run in and why (`draft_weights`): "native"
      for a model run as loaded.
    - `feature_taps`: layers whose normalised inputs a pass that returns hidden states appends to each row's
      final features, [H] -> [H * (1 + len(feature_taps))] (the low and mid features of an EAGLE-3-style
      feature draft, `models.feature_draft`); set for the oracle such a draft reads.  Empty: the final
      features alone.
    """

    passes: PassRuntime = field(default_factory=PassRuntime)
    native_stack: Callable[..., Any] | None = None
    head_row_plan: tuple[tuple[bool, int], ...] | None = None
    matmul_plan_signature: str | None = None
    weight_format: str = "native"
    weight_reason: str = ""
    feature_taps: tuple[int, ...] = ()
