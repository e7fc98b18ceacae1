"""The configurations `--method auto` chooses among (`Arm`), which of them to price, and their sizes:
the rows each puts in the oracle's pass and the prompt-lookup chains they propose."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

LOOKUP_SIZES = (1, 2, 3, 4, 6)
# `copy:k`: the prompt-lookup chain alone, without the n-gram's two chains.  A `lookup` arm verifies all three
# (up to 1 + 3k rows); where rows are dear (the native int4 kernels) and the n-gram is seldom right, that priced
# every lookup out and `auto` ran HumanEval as `ar`
# (docs/measurements.md, "Lookup arms priced out on HumanEval on a Zen 4 EPYC").
COPY_SIZES = (1, 2, 4, 8)
CPU_TREE_SIZES = (2, 4, 8, 16)
CUDA_TREE_SIZES = (2, 4, 8, 16, 32, 64)
# Fans: the root's k most likely children, one draft pass (`tree:kd1`), and a chain of one (`tree:1`).  A feature
# draft pays a pass per level, and a second level brought little: on the Qwen oracle (int4, Zen 5) a fan of 3 ran
# at 1.26-1.28x `ar` on prose and chat, a chain of one at 1.22-1.24x and a chain of two at 1.08-1.14x, while `auto`,
# all of whose tree arms were 2-7 levels deep, ran at 1.13-1.19x (docs/measurements.md, "Fans of the root's
# children on a Zen 5 EPYC").
FAN_SIZES = (2, 3, 4)
TREE_BRANCHING = 2  # children a node of a deeper tree arm may get (a fan's root gets all of its nodes)
STAGE_SIZES = (1, 2, 3, 4, 6)
# `staged:k+m` arms also merge a long chain: where verification rows are nearly free (a CPU with native bf16,
# a GPU) the copies it catches are long; where rows are dear the pricing leaves these arms alone.  The fixed
# `staged` merges this many on a native-bf16 CPU, where it pays
# (docs/measurements.md, "A longer prompt-lookup chain in `staged` on an AMX Xeon").
STAGE_LONG_LOOKUP = 8
# A `staged:k` arm merges a prompt-lookup chain one token longer than its draft's k, as the tuned fixed
# configurations do (bf16: 3 draft + 4 lookup; int4: 1 + 2, which no arm could express without this, and
# `auto@int4` then ran behind `staged@int4`;
# docs/measurements.md, "`auto@int4` without a longer lookup chain on an AMX Xeon").
STAGE_LOOKUP_EXTRA = 1


@dataclass(frozen=True)
class Arm:
    """One configuration `--method auto` can run for a step.

    Its name, family and hash are computed once: the policy looks arms up in dicts tens of times a step."""

    kind: str  # "ar" | "lookup" | "copy" | "tree" | "staged"
    size: int = 0  # lookup / copy chain length / tree nodes / tokens the draft stage decodes
    lookup: int = 0  # staged: tokens of the merged prompt-lookup chain (0: size + STAGE_LOOKUP_EXTRA)
    depth: int = 0  # tree: the most levels (0: `tree_depth_for(size)`); 1 is a fan of the root's children
    # "ar", or "kind:size" with "+lookup" for a staged arm merging a long chain, "dN" for a tree of N levels
    name: str = field(init=False, compare=False, repr=False)
    # Arms the chain model prices alike, whose calibrations are pooled (`AcceptanceStats.calibration`): the
    # kind, with `staged` arms merging a long lookup chain apart (the model overrates that chain).
    family: str = field(init=False, compare=False, repr=False)
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        name = "ar" if self.kind == "ar" else f"{self.kind}:{self.size}" + (f"+{self.lookup}" if self.lookup else "")
        name += f"d{self.depth}" if self.depth else ""
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "family", f"{self.kind}+" if self.lookup else self.kind)
        object.__setattr__(self, "_hash", hash((self.kind, self.size, self.lookup, self.depth)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def tree_depth(self) -> int:
        """A tree arm's most levels: its own `depth`, else deep enough for long accepts (`tree_depth_for`)."""
        return self.depth or tree_depth_for(self.size)

    @property
    def tree_branching(self) -> int:
        """Children a node of this tree arm may get: every node of a fan at the root, else `TREE_BRANCHING`."""
        return self.size if self.tree_depth == 1 else TREE_BRANCHING

    @property
    def max_tree_budget(self) -> int:
        """Most non-root nodes this arm can put in the oracle's tree."""
        if self.kind == "lookup":
            return 3 * self.size  # the context chain and two n-gram chains
        if self.kind == "copy":
            return self.size
        if self.kind == "staged":
            return self.size + staged_lookup_length(self)  # the draft's chain and the merged context chain
        return self.size


def arms_for(has_lookup: bool, has_draft: bool, device: str = "cpu", kind: str | None = None,
             has_context: bool | None = None) -> list[Arm]:
    """Every configuration worth pricing, given what can propose (`has_context`: prompt lookup, default
    `has_lookup`); `kind`: only `ar` and that kind's arms (a method whose sizes are measured,
    `SpeculationConfig.sizing`; `lookup`'s include the `copy` arms)."""
    if kind is not None:
        kinds = ("ar", kind, "copy") if kind == "lookup" else ("ar", kind)
        return [a for a in arms_for(has_lookup, has_draft, device, has_context=has_context) if a.kind in kinds]
    arms = [Arm("ar")]
    if has_lookup:
        arms += [Arm("lookup", k) for k in LOOKUP_SIZES]
    if has_lookup if has_context is None else has_context:
        arms += [Arm("copy", k) for k in COPY_SIZES]
    if has_draft:
        sizes = CUDA_TREE_SIZES if device.startswith("cuda") else CPU_TREE_SIZES
        arms += [Arm("tree", 1), *(Arm("tree", k, depth=1) for k in FAN_SIZES)]
        arms += [Arm("tree", n) for n in sizes]
        arms += [Arm("staged", k) for k in STAGE_SIZES]
        arms += [Arm("staged", k, STAGE_LONG_LOOKUP) for k in STAGE_SIZES if k + STAGE_LOOKUP_EXTRA < STAGE_LONG_LOOKUP]
    return arms


# The prompt-lookup chain's acceptance series, by the length of the suffix it matched (`ContextDrafter`: 3 tokens
# down to 1).  A one-token match is mostly chance, a three-token one mostly right; prose and chat propose mostly
# one-token matches, code mostly three-token ones, so one series learned on code had priced chat's copies at
# several tokens a step where they yielded one
# (docs/measurements.md, "Prompt-lookup copies by matched length on an H200").
CONTEXT_SERIES = {1: "context:1", 2: "context:2"}  # a longer match: "context"


def context_series(matched: int) -> str:
    """The acceptance series of a prompt-lookup chain copied after a suffix of `matched` tokens."""
    return CONTEXT_SERIES.get(matched, "context")


def context_chain(lookup_lengths: Mapping[str, int]) -> tuple[str, int]:
    """This step's prompt-lookup chain: its series (`context_series`) and length (0: none)."""
    for name in ("context", *CONTEXT_SERIES.values()):  # a step has one prompt-lookup chain, in one series
        length = lookup_lengths.get(name, 0)
        if length:
            return name, length
    return "context", 0


def tree_depth_for(nodes: int) -> int:
    """The depth of an n-node tree arm: deep enough for long accepts, wide enough to hedge."""
    return max(1, min(nodes, round(1.5 * math.sqrt(nodes)) + 1, 8))


def verify_rows(arm: Arm, lookup_lengths: Mapping[str, int]) -> int:
    """Rows of the oracle's pass for `arm` (root included); `lookup_lengths`: this step's chains, keyed by
    series (`context_chain`, "ngram")."""
    if arm.kind == "ar":
        return 1
    copied = context_chain(lookup_lengths)[1]
    if arm.kind == "lookup":
        return 1 + min(arm.size, copied) + 2 * min(arm.size, lookup_lengths.get("ngram", 0))
    if arm.kind == "copy":
        return 1 + min(arm.size, copied)
    if arm.kind == "staged":
        return 1 + arm.size + min(staged_lookup_length(arm), copied)
    return 1 + arm.size


def staged_lookup_length(arm: Arm) -> int:
    """Tokens of the prompt-lookup chain a `staged` arm merges into the oracle's tree."""
    return arm.lookup or arm.size + STAGE_LOOKUP_EXTRA


def lookup_horizon(arms: Iterable[Arm]) -> int:
    """The longest prompt-lookup chain any of `arms` proposes (so the chains scored every step reach it)."""
    lengths = [a.size for a in arms if a.kind in ("lookup", "copy")] + [staged_lookup_length(a) for a in arms
                                                              if a.kind == "staged"]
    return max(lengths, default=max(LOOKUP_SIZES))
