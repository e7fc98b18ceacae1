"""How a request speculates (`SpeculationConfig`): its method, the sizes of its trees and chains, and how those
sizes are chosen; with the defaults each machine kind gets (`SpeculationConfig.tuned`).

What a method takes (drafts, the model-free bottom stage, measured sizing) is asked of its record in
`stagedspec.methods`.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass
from typing import Any, Mapping

import torch

from stagedspec import hardware
from stagedspec.drafters.model import GROWTHS
from stagedspec.dtypes import resolve_dtype
from stagedspec.errors import StagedSpecError
from stagedspec.methods import METHODS, method_named


# Speculation defaults on int4/int8 oracle weights (see `SpeculationConfig.tuned`).
QUANTISED_DEFAULTS = {"tree_budget": 2, "tree_depth": 2, "chain_length": 2, "lookup_length": 2,
                      "stage_length": 1}
# On a GPU with CUDA graphs a 16-row oracle pass costs 1.2x a 1-row one and 64 rows 1.3x (H100, docs/gpu.md),
# while each draft pass costs about as much host work as an oracle pass: so wider trees at the same depth
# (more nodes per draft pass) and longer lookup chains (free to propose).
CUDA_DEFAULTS = {"tree_budget": 16, "tree_branching": 4, "lookup_length": 8}
# bf16 on a CPU with native bf16 (AVX-512 BF16 or AMX): a verification row costs next to nothing, so `staged`
# merges a longer prompt-lookup chain into the oracle's tree.  Where rows are dear (AVX2 CPUs), the chain stays
# `lookup_length` long (docs/measurements.md, "A longer prompt-lookup chain in `staged` on an AMX Xeon").
NATIVE_BF16_DEFAULTS = {"oracle_lookup_length": 8}
SIZINGS = ("fixed", "measured")
# Every size has one name, <what it sizes>_<dimension>: the `SpeculationConfig` field, the server's
# `speculation` field, and with dashes the CLI's flag (`--tree-budget`).
SIZE_FIELDS = ("tree_budget", "tree_depth", "tree_branching", "chain_length", "lookup_length", "stage_length",
               "stage_branching", "oracle_lookup_length")
# The names three of them had up to stagedspec 0.1.0; accepted by 0.1.1, with a one-line notice, and no later.
RENAMED_SIZES = {"branching": "tree_branching", "lookup_chain_length": "lookup_length",
                 "stage_chain_length": "stage_length"}


def renamed_size_notice(old: str, flags: bool = False) -> str:
    """The one line that says an old size name was used: as a flag (`flags`) or a keyword."""
    new = RENAMED_SIZES[old]
    if flags:
        old, new = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    return f"{old} is now called {new}; the old name will stop working in the next release"
  # how a sizable method's sizes are chosen (`SpeculationConfig.sizing`)


@dataclass
class SpeculationConfig:
    """How drafts are proposed.

    Defaults were tuned on the reference 2-core CPU with the default models, where a bf16 pass over a few
    tokens costs about what one token costs and more rows cost more
    (docs/measurements.md, "bf16 pass cost by row count on the AVX-512 BF16 EPYC"), so small trees of likely
    tokens beat wide ones.

    - chain / tree: one draft model proposes for the oracle;
    - lookup: model-free drafts (prompt lookup and/or an n-gram) for the oracle;
    - auto: each step, whichever of ar / lookup / tree / staged (and of
      their sizes) this machine's measured costs and the acceptance so far
      say is fastest (`stagedspec.auto`); the other fields do not apply;
    - staged: oracle <- draft model(s) <- lookup; each model stage decodes
      `stage_length` tokens per proposal speculatively against the stage below;
      with `oracle_lookup` the prompt-lookup chain is also merged into the
      tree the oracle verifies (it catches the copies a small draft misses).
    """

    method: str = "auto"
    tree_budget: int = 8
    tree_depth: int = 4
    tree_branching: int = 2
    chain_length: int = 4
    ngram: str | None = None  # n-gram spec for lookup/staged: "default" or a file
    context: bool = True  # prompt lookup at the bottom of lookup/staged
    lookup_length: int = 4  # tokens per lookup chain
    stage_length: int = 3  # tokens each model stage decodes per proposal
    stage_branching: int = 1  # spine token + (b - 1) alternatives per position
    oracle_lookup: bool = True  # staged: prompt-lookup chains also go straight to the oracle's tree
    oracle_lookup_length: int | None = None  # staged: tokens of that chain (None: lookup_length)
    adaptive_budget: bool = False  # tree: verify only the nodes that pay for themselves (tree_budget = the most)
    # tree: "best-first" on the host, "levels" on the device with one copy back (`stagedspec.tree_levels`),
    # "auto": levels where a copy back waits for the device (CUDA), best-first on a CPU
    tree_growth: str = "auto"
    # tree / lookup / staged: "fixed" runs the sizes above every step; "measured" lets `auto`'s policy pick,
    # each step, `ar` or one of this method's sizes by this machine's measured costs and the acceptance so
    # far (`Pipeline.sized_policy`), so the method is never knowingly slower than plain decoding.  The
    # CLI, the server and the bench run "measured" unless a size is given; the library keeps "fixed".
    sizing: str = "fixed"
    # The old names of three sizes (`RENAMED_SIZES`), taken as keywords for one more release.  Reading them
    # gives None: read the new names.
    branching: InitVar[int | None] = None
    lookup_chain_length: InitVar[int | None] = None
    stage_chain_length: InitVar[int | None] = None

    def __post_init__(self, branching: int | None, lookup_chain_length: int | None,
                      stage_chain_length: int | None) -> None:
        for old, value in (("branching", branching), ("lookup_chain_length", lookup_chain_length),
                           ("stage_chain_length", stage_chain_length)):
            if value is not None:
                warnings.warn(renamed_size_notice(old), FutureWarning, stacklevel=3)
                setattr(self, RENAMED_SIZES[old], value)
        method_named(self.method)  # an unknown method: the one error every front end gives
        if self.sizing not in SIZINGS:
            raise StagedSpecError(f"unknown --sizing {self.sizing!r}: use one of {', '.join(SIZINGS)}")
        for label, value in (("--tree-budget", self.tree_budget), ("--tree-depth", self.tree_depth),
                             ("--tree-branching", self.tree_branching), ("--chain-length", self.chain_length),
                             ("--lookup-length", self.lookup_length),
                             ("--stage-length", self.stage_length),
                             ("--stage-branching", self.stage_branching),
                             ("--oracle-lookup-length",
                              1 if self.oracle_lookup_length is None else self.oracle_lookup_length)):
            if value < 1:
                raise StagedSpecError(f"{label} must be >= 1, got {value}")
        if self.tree_growth not in GROWTHS:
            raise StagedSpecError(f"unknown --tree-growth {self.tree_growth!r}: use one of {', '.join(GROWTHS)}")

    @classmethod
    def tuned(cls, method: str, quant: str = "none", device: str = "cpu", dtype: str | torch.dtype | None = None,
              **overrides: Any) -> "SpeculationConfig":
        """The defaults for `method` on `quant` oracle weights, `device` and `dtype` (a --dtype value or a
        torch dtype; None: not known), with `overrides` (None = keep them).

        On a CPU with native bf16, bf16 verification rows are nearly free, so
        `staged` merges a longer prompt-lookup chain (`NATIVE_BF16_DEFAULTS`)
        unless `lookup_length` is given.

        On CUDA (`CUDA_DEFAULTS`), verification rows are nearly free and draft
        passes are not, so trees are wider at the same depth and lookup chains
        longer.

        Quantised layers make extra rows dear: PyTorch's int4 CPU kernel runs
        rows in blocks of four, so a pass over 5-8 tokens costs about twice one
        over 1-4 (`bench-engine --tree-cost --dtypes int4`: 4 tokens 1.13x,
        8 tokens 1.72x), while the oracle pass itself got 2x cheaper than the
        draft's.  On int4/int8 the proposals therefore stay within four rows.
        """
        for old, new in RENAMED_SIZES.items():
            if overrides.get(old) is not None:
                warnings.warn(renamed_size_notice(old), FutureWarning, stacklevel=2)
                overrides[new] = overrides.pop(old)
        values: dict[str, Any] = dict(QUANTISED_DEFAULTS) if quant != "none" else {}
        if str(device).startswith("cuda") and quant == "none":
            values.update(CUDA_DEFAULTS)
        m = method_named(method)
        if quant != "none":
            values.update(m.quantised_sizes)
        if (m.merges_lookup and quant == "none" and overrides.get("lookup_length") is None
                and _native_bf16_cpu(device, dtype)):
            values.update(NATIVE_BF16_DEFAULTS)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(method=method, **values)

    @property
    def measured(self) -> bool:
        """Whether each step's size is chosen by the measured costs (`sizing`): `auto`, or a method that
        can be sized so and is asked to be."""
        m = METHODS[self.method]
        return m.always_measured or (self.sizing == "measured" and m.sizable)

    @property
    def merged_lookup_length(self) -> int:
        """staged: tokens of the prompt-lookup chain merged into the oracle's tree."""
        return self.oracle_lookup_length or self.lookup_length

    @property
    def max_tree_budget(self) -> int:
        """Most tree nodes the oracle may be asked to verify in one step."""
        if self.measured:  # the biggest arm the policy may run on any device
            # deferred: the CLI's parser loads this module (its defaults); auto's arms load only for a measured method
            from stagedspec.auto import arms_for

            return max(arm.max_tree_budget for arm in arms_for(True, True, "cuda", sized_method(self.method)))
        lookup = self.merged_lookup_length if self.oracle_lookup else 0
        staged = self.stage_length * self.stage_branching + lookup
        return max(self.tree_budget, self.chain_length, staged, self.lookup_length * 3)


def sized_method(method: str) -> str | None:
    """The arm kind a measured method's policy is restricted to (None: `auto`, every kind)."""
    return None if METHODS[method].always_measured else method


def choose_sizing(method: str, sizing: str | None, given: Mapping[str, Any]) -> str:
    """The sizing a command line asks for: `sizing` if given, else "fixed" when one of `method`'s size fields
    (`Method.every_size_field`) is in `given` (flag values, None = not given), else "measured" (it matters
    for sizable methods only).
    Naming a size together with `--sizing measured` is an error: the policy would ignore it."""
    fields = method_named(method).every_size_field
    named = [f for f in fields if given.get(f) is not None]
    if sizing == "measured" and named:
        flags = ", ".join("--" + f.replace("_", "-") for f in named)
        raise StagedSpecError(f"--sizing measured picks {method}'s sizes each step; drop {flags} or use "
                              f"--sizing fixed")
    if sizing is not None:
        return sizing
    return "fixed" if named else "measured"


def _native_bf16_cpu(device: str, dtype: str | torch.dtype | None) -> bool:
    """Whether passes run in bf16 on a CPU whose bf16 matmuls are native (`hardware.cpu_has_native_bf16`)."""
    if dtype is None or not str(device).startswith("cpu"):
        return False
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, "cpu")[0]
    return dtype == torch.bfloat16 and hardware.cpu_has_native_bf16()
