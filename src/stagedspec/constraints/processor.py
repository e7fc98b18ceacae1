"""The per-request logits processor: logit bias and grammar masks on every row that becomes p or q.

Exactness with speculation (docs/exactness.md, "Constrained decoding").
The target is the *constrained* distribution: at each step, the oracle's
logits plus the bias, with the tokens the grammar forbids after the text so
far set to -inf, then temperature / top-k / top-p as usual.  A tree's rows
are scored under the state of their own path: row u gets the grammar state
after the generated text, then the tokens of u's ancestors and u (the root
is the last committed token).  So every row the verifier reads is exactly
the row constrained `ar` would compute after that path, and the verification
rules (`stagedspec.verification`) reproduce it.  The drafts propose under the
same masks (a draft's row for node u uses u's state too), so a drafted token
is never one the oracle gives probability 0, and the q a sampled token was
drawn from is the masked one that verification is given.  Which nodes a
tree has may depend on the masks (a lookup chain is cut at its first token
the grammar forbids): they follow from the drafts and the history, never
from this step's oracle result.

With no bias and no grammar nothing here is made: the loop runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from stagedspec.constraints.grammar import GrammarSpec, GrammarState, walk
from stagedspec.constraints.logit_bias import BiasVector, parse_logit_bias
from stagedspec.tree import TokenTree


@dataclass(frozen=True)
class LogitControls:
    """What a request asks of the logits: a bias per token and/or a grammar (None: neither)."""

    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = None

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.grammar is not None


class LogitsProcessor:
    """One request's bias and grammar states, applied to logits rows by the path each row follows.

    `begin(prompt)` anchors the grammar at the first generated token;
    `settle(context)` (after the oracle commits) forgets the states above
    the committed text, so memory stays at about one tree's worth of states.
    """

    def __init__(self, vocab_size: int, bias: Mapping[int, float] | None = None,
                 grammar: GrammarState | None = None) -> None:
        self.bias = BiasVector(bias, vocab_size) if bias else None
        self.initial = grammar
        self._root: GrammarState | None = grammar  # the state after context[:self._offset]
        self._offset = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._root, self._offset = self.initial, len(prompt_ids)

    def settle(self, context: Sequence[int]) -> None:
        """`context` is committed: later paths all extend it."""
        if self._root is not None:
            self._root = walk(self._root, context[self._offset:])
            self._offset = len(context)

    def state(self, context: Sequence[int]) -> GrammarState | None:
        """The grammar state after `context` (None without a grammar)."""
        if self._root is None:
            return None
        if len(context) < self._offset:
            raise ValueError("a constrained path must extend the committed text")
        return walk(self._root, context[self._offset:])

    def rows(self, context: Sequence[int], tree: TokenTree, nodes: Sequence[int], logits: Tensor) -> Tensor:
        """float32 logits [len(nodes), V] of `nodes` of `tree` (rooted at `context[-1]`), biased and masked."""
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias.on(out.device)
        base = self.state(context)
        if base is None:
            return out
        states: dict[int, GrammarState] = {0: base}

        def state_of(node: int) -> GrammarState:
            found = states.get(node)
            if found is None:
                found = states[node] = state_of(tree.parents[node]).child(tree.tokens[node])
            return found

        allowed = torch.stack([state_of(n).allowed() for n in nodes]).to(out.device, non_blocking=True)
        return out.masked_fill(~allowed, float("-inf"))

    def allowed_prefix(self, context: Sequence[int], tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts after `context` (all of them without a grammar).

        A token with a -inf bias counts as accepted: the bias is not a mask (a
        -100 token keeps a tiny probability, as in OpenAI's API).
        """
        state = self.state(context)
        if state is None:
            return len(tokens)
        for i, token in enumerate(tokens):
            if not bool(state.allowed()[token]):
                return i
            state = state.child(token)
        return len(tokens)


def build_processor(controls: LogitControls | None, vocab_size: int,
                    compiler: Callable[[], Any]) -> LogitsProcessor | None:
    """A request's processor, or None when it asks for nothing (then nothing is wrapped: zero cost).

    `compiler` returns the `GrammarCompiler` of the model's tokenizer (called only for a grammar).
    Bad input raises `StagedSpecError` with one line.
    """
    if controls is None or not controls.active:
        return None
    bias = parse_logit_bias(controls.logit_bias, vocab_size) if controls.logit_bias else None
    state = None
    if controls.grammar is not None:
        grammar_compiler = compiler()
        state = grammar_compiler.initial_state(grammar_compiler.compile(controls.grammar))
    return LogitsProcessor(vocab_size, bias, state)


class ConstrainedOracle:
    """An `Oracle` (the loop's, or a draft stage's) whose rows come back biased and masked by their path.

    `settles`: this is the request's own oracle (not a stage drafting for it),
    so its prefill anchors the grammar and its commits settle the processor.
    Every other attribute is the wrapped oracle's (feature drafts read its
    hidden states; the loop reads `bit_exact` and `forward_passes`).
    """

    def __init__(self, inner: Any, processor: LogitsProcessor, settles: bool = False) -> None:
        self.inner, self.processor, self.settles = inner, processor, settles
        self._before_root: list[int] = []
        self._tree: TokenTree | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    @property
    def bit_exact(self) -> bool:
        return self.inner.bit_exact

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.inner.prefill(prompt_ids)
        self._before_root = list(prompt_ids[:-1])
        if self.settles:
            self.processor.begin(prompt_ids)

    def score(self, tree: TokenTree) -> Tensor:
        logits = self.inner.score(tree)
        self._tree = tree
        context = [*self._before_root, tree.tokens[0]]
        return self.processor.rows(context, tree, range(len(tree)), logits)

    def commit(self, accepted: Sequence[int]) -> None:
        self.inner.commit(accepted)
        assert self._tree is not None
        self._before_root += [self._tree.tokens[0], *(self._tree.tokens[i] for i in accepted)]
        if self.settles:
            self.processor.settle(self._before_root)
