"""Model-free drafters for the bottom of a stage chain: n-gram and prompt lookup.

Both cost microseconds per proposed token, so they can speculate for a draft
model (or directly for the oracle) at no measurable cost.  Proposals are
deterministic, so verification treats each node as a one-hot q and stays
exact under any sampling settings.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stagedspec.constraints.processor import LogitsProcessor
from stagedspec.drafters.base import Drafter, check_size
from stagedspec.drafters.context import ContextDrafter
from stagedspec.drafters.ngram import NgramModel
from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree


def _add_path(tree: TokenTree, tokens: Sequence[int], proposer: str) -> None:
    """Add a chain under the root, reusing nodes an earlier path already created."""
    node = 0
    for tok in tokens:
        child = tree.child_with(node, tok)
        node = child if child is not None else tree.add(node, tok, proposer)


class LookupDrafter(Drafter):
    """Chains from prompt lookup ("context") and/or an n-gram ("ngram"), merged into one tree.

    - context: the continuation of the most recent earlier occurrence of the
      current suffix (prompt + everything generated so far);
    - ngram: the n-gram's `branching` most likely next tokens, each continued
      greedily, so the tree hedges where the n-gram is unsure.
    """

    def __init__(
        self,
        ngram: NgramModel | None = None,
        context: bool = True,
        *,
        chain_length: int = 6,
        branching: int = 2,
        processor: LogitsProcessor | None = None,
    ) -> None:
        """`processor`: a request's grammar (`stagedspec.constraints`); each chain is cut at its first token the
        grammar forbids after the path before it, which the oracle would give probability 0."""
        if ngram is None and not context:
            raise StagedSpecError("a lookup drafter needs an n-gram model, prompt lookup, or both")
        if chain_length < 1 or branching < 1:
            raise StagedSpecError(f"lookup chain length and branching must be >= 1, got {chain_length}, {branching}")
        self.ngram = ngram
        self.context = ContextDrafter() if context else None
        self.chain_length, self.branching = chain_length, branching
        self.forward_passes = 0  # a lookup is not a forward pass
        self.processor = processor
        self._known: list[int] = []

    @property
    def name(self) -> str:
        return "+".join(n for n, on in (("context", self.context is not None), ("ngram", self.ngram is not None)) if on)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._sync(prompt_ids)

    def resize(self, *, chain_length: int | None = None, tree_budget: int | None = None,
               max_depth: int | None = None, branching: int | None = None) -> None:
        """`chain_length`: the longest chain proposed (`--method auto`'s `lookup:k` arms, and the horizon its
        lookup chains are scored to)."""
        # chains have no tree knobs: refused
        super().resize(tree_budget=tree_budget, max_depth=max_depth, branching=branching)
        check_size("lookup chain length", chain_length)
        if chain_length is not None:
            self.chain_length = chain_length

    def _sync(self, context: Sequence[int]) -> None:
        """Follow the context incrementally; restart only when it is not an extension of what we saw."""
        if self.context is None:
            return
        known, n = self._known, len(self._known)
        if len(context) >= n and list(context[:n]) == known:
            self.context.update(context[n:])
        else:
            # Below a model stage the context often takes back a few speculative tokens: undo those
            # instead of re-indexing the prompt, unless most of what was seen differs (a new prompt).
            same = next((i for i, (a, b) in enumerate(zip(context, known)) if a != b), min(len(context), n))
            if n - same <= same:
                self.context.truncate(same)
                self.context.update(context[same:])
            else:
                self.context.reset(context)
        self._known = list(context)

    def chains(self, context: Sequence[int], max_tokens: int) -> list[tuple[str, list[int]]]:
        """The proposed chains as (proposer, tokens), best first per proposer: what `propose` merges.

        `--method auto` also reads them to learn each proposer's acceptance,
        whether or not the step verifies them.
        """
        self._sync(context)
        n = max(0, min(self.chain_length, max_tokens))
        out: list[tuple[str, list[int]]] = []
        if n == 0:
            return out
        if self.context is not None:
            chain = [t for t, _ in self.context.propose_chain(n)]
            if chain:
                out.append(("context", chain))
        if self.ngram is not None:
            order = self.ngram.order
            tail = list(context[-(order - 1):])
            for tok, _ in self.ngram.top_k(tail, self.branching):
                rest = self.ngram.propose_chain((tail + [tok])[-(order - 1):], n - 1) if n > 1 else []
                out.append(("ngram", [tok] + [t for t, _ in rest]))
        return out

    def context_match(self) -> int:
        """Tokens of the suffix the last `chains` call's prompt-lookup chain was copied after (0: no chain)."""
        return self.context.match_length() if self.context is not None else 0

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        tree = TokenTree([context[-1]], [-1])
        for proposer, chain in self.chains(context, max_tokens):
            if self.processor is not None:
                chain = chain[: self.processor.allowed_prefix(context, chain)]
            _add_path(tree, chain, proposer)
        return tree
