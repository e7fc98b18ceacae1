"""The registry of decoding methods: what each one takes.

Why one registry: a method used to be a string compared in dozens of places (which need a draft, which read
the n-gram, which can be sized by measured costs), and each comparison was one more place for the CLI, the
library and the server to disagree.  Every question about a method is asked of its `Method` record here;
`stagedspec.drafting` builds a request's drafter from it.  This module imports nothing of the package but
its errors, so every layer may read it.

    ar       plain decoding: no drafter
    chain    one draft model proposes a chain of `chain_length` tokens
    tree     one draft model grows a best-first tree under `tree_budget`
    lookup   model-free: prompt lookup and/or the n-gram propose chains
    staged   oracle <- draft model(s) <- lookup, each stage exact against the one below
    auto     each step, whichever of those this machine's measured costs make fastest (`stagedspec.auto`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stagedspec.errors import StagedSpecError


@dataclass(frozen=True)
class Method:
    """One decoding method, as every layer sees it.

    `drafts`: the draft models it runs: "none" (ar, lookup), "one" (chain, tree: exactly one), "stages"
    (staged: one or more, from the stage below the oracle downwards), "any" (auto: the ones given, else
    the draft found for the oracle).  `bottom`: it reads the model-free proposers (prompt lookup, the
    n-gram).  `sizable`: each step's size may be chosen by measured costs (`--sizing measured`); `auto`
    always chooses.  `size_fields`: the `SpeculationConfig` fields that size it; naming one on a command
    line asks for fixed sizes."""

    name: str
    drafts: str
    bottom: bool
    sizable: bool
    size_fields: tuple[str, ...] = ()
    merges_lookup: bool = False
    quantised_sizes: tuple[tuple[str, int], ...] = ()
    default_ngram: bool = False  # the CLI gives it the default n-gram unless told otherwise

    @property
    def uses_drafts(self) -> bool:
        """Whether a request of this method runs draft models at all."""
        return self.drafts != "none"

    @property
    def speculates(self) -> bool:
        """Whether anything is drafted at all (every method but `ar`)."""
        return self.uses_drafts or self.bottom

    @property
    def needs_drafts(self) -> bool:
        """Whether it cannot run without a draft model."""
        return self.drafts in ("one", "stages")

    @property
    def always_measured(self) -> bool:
        return self.name == "auto"

    def check_drafts(self, drafts: Sequence[str]) -> None:
        """A one-line error when `drafts` (the specs given) cannot run this method."""
        if self.drafts == "one" and len(drafts) != 1:
            raise StagedSpecError(f"method {self.name!r} needs exactly one draft: pass --draft SPEC")
        if self.drafts == "stages" and not drafts:
            raise StagedSpecError(f"method {self.name!r} needs at least one draft model stage (--draft or "
                                  "--stages); for model-free drafting use --method lookup")

    @property
    def every_size_field(self) -> tuple[str, ...]:
        """The size fields a request of this method may name: its own, or for `auto` (which a server request
        may switch to any method) every method's."""
        if not self.always_measured:
            return self.size_fields
        return tuple(dict.fromkeys(f for m in METHODS.values() for f in m.size_fields))

    def check_bottom(self, has_ngram: bool, context: bool) -> None:
        """A one-line error when a method built on a model-free bottom stage has none (`auto` runs without)."""
        if self.bottom and not self.always_measured and not has_ngram and not context:
            raise StagedSpecError(f"method {self.name!r} needs a bottom stage: an n-gram (--ngram) or prompt lookup")


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("auto", drafts="any", bottom=True, sizable=True, default_ngram=True),
    Method("ar", drafts="none", bottom=False, sizable=False),
    Method("chain", drafts="one", bottom=False, sizable=False),
    Method("tree", drafts="one", bottom=False, sizable=True,
           size_fields=("tree_budget", "tree_depth", "tree_branching", "adaptive_budget")),
    # a quantised pass of 2 rows costs about what 1 costs, so a copied token is checked alone
    Method("lookup", drafts="none", bottom=True, sizable=True, size_fields=("lookup_length",),
           quantised_sizes=(("lookup_length", 1),)),
    Method("staged", drafts="stages", bottom=True, sizable=True,
           size_fields=("stage_length", "stage_branching", "lookup_length", "oracle_lookup_length",
                        "oracle_lookup"), merges_lookup=True, default_ngram=True),
)}
METHOD_NAMES = tuple(METHODS)


def method_named(name: str) -> Method:
    """The method called `name`, or the one-line error every front end gives for an unknown one."""
    try:
        return METHODS[name]
    except KeyError:
        raise StagedSpecError(f"unknown method {name!r}: use one of {', '.join(METHOD_NAMES)}") from None
