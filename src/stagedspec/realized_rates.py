"""What one request's steps actually yielded per second, against what `auto` priced them at.

Why: `auto` prices an arm from models (the cost curve scaled by measured
times, per-depth acceptance scaled by each arm's record).  Those models are
shared by every request on the machine and learn slowly on purpose, so that
one slow step does not rule.  Where an arm's price sits within 10-20% of plain
decoding's, their residual error decides the choice, and a request can keep
choosing an arm that loses: on the Qwen2.5-Coder pair `tree:2` with the 0.5B
draft was priced just above `ar` on prose and ran a prompt's steps well below
`ar`'s speed (docs/measurements.md, "`tree:2` priced just above `ar` on an AVX2 EPYC").

So each request keeps, per arm kind, the tokens and wall seconds its steps
took and the tokens and seconds they were priced at when chosen.  The ratio of
the realized rate to the priced one, shrunk towards 1 by `PRIOR_STEPS` steps'
worth of agreement, multiplies that kind's price for the rest of the request.
An arm kind that loses to its price is dropped within a handful of steps,
whichever part of the model was wrong; `ar`'s own ratio is kept the same way,
so a host that runs slower for a while moves every kind alike and changes no
choice.

Exactness: the ratios depend on earlier steps only, never on this step's
oracle result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_STEPS = 4.0  # steps' worth of "the price was right" each kind's ratio starts from
FLOOR, CEILING = 0.25, 2.0  # a kind's ratio stays within these: a stall or a lucky run does not rule alone


@dataclass
class KindRecord:
    """One arm kind's steps in this request: what they yielded and took, and what they were priced at."""

    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0
    priced_tokens: float = 0.0
    priced_seconds: float = 0.0

    def ratio(self, prior_steps: float = PRIOR_STEPS) -> float:
        """Realized tokens per second / priced tokens per second, each side shrunk by `prior_steps` steps
        that went as priced (so 1.0 before any step, and the plain ratio after many)."""
        if self.steps == 0 or self.priced_tokens <= 0 or self.priced_seconds <= 0:
            return 1.0
        prior_tokens = prior_steps * self.priced_tokens / self.steps
        prior_seconds = prior_steps * self.priced_seconds / self.steps
        token_ratio = (self.tokens + prior_tokens) / (self.priced_tokens + prior_tokens)
        time_ratio = (self.seconds + prior_seconds) / (self.priced_seconds + prior_seconds)
        return min(CEILING, max(FLOOR, token_ratio / time_ratio))


@dataclass
class RealizedRates:
    """Per arm kind, this request's realized / priced rate (`KindRecord.ratio`); one per request."""

    kinds: dict[str, KindRecord] = field(default_factory=dict)

    def observe(self, kind: str, tokens: float, seconds: float, priced_tokens: float, priced_seconds: float) -> None:
        """One whole step of `kind` (priced alone): `tokens` emitted in `seconds` of wall time, against the
        `priced_tokens` and `priced_seconds` it was chosen with."""
        if seconds <= 0 or priced_seconds <= 0 or priced_tokens <= 0:
            return
        record = self.kinds.setdefault(kind, KindRecord())
        record.steps += 1
        record.tokens += tokens
        record.seconds += seconds
        record.priced_tokens += priced_tokens
        record.priced_seconds += priced_seconds

    def factor(self, kind: str) -> float:
        """The multiplier of `kind`'s priced rate.  A kind this request has not run yet gets `ar`'s (how the
        host runs now against the prices), so a slow spell of plain steps does not favour untried arms."""
        record = self.kinds.get(kind) or self.kinds.get("ar")
        return record.ratio() if record is not None else 1.0
