"""An independent reference for the distribution a token is drawn from, written in numpy from the definitions.

Why a second implementation: the chi-square tests compare the engine's samples with "the oracle's
distribution".  If that distribution were computed with the engine's own `probs_from_logits`, a mistake in
it (temperature applied after top-k, an off-by-one in the top-p cut) would sit on both sides of the test and
cancel.  This module shares no code with `stagedspec.sampling`: float64 numpy, no torch ops.

The definitions, and the conventions `stagedspec.sampling.probs_from_logits` documents in its code:

- temperature 0: one-hot on the largest logit, the first index among ties;
- otherwise the order is temperature, then top-k, then top-p:
  - temperature T: the logits are divided by T before anything else;
  - top-k k (0 or k >= V disables): keep every token whose scaled logit is >= the k-th largest scaled
    logit, so tokens tied with the k-th are all kept (possibly more than k), and renormalise by a softmax
    over the kept tokens;
  - top-p p (1 disables): sort the (top-k) probabilities in decreasing order and keep the shortest prefix
    whose mass reaches p, i.e. a token is kept iff the mass strictly more probable than it in that order is
    < p; the token whose probability carries the mass across p is kept.  Then renormalise.  Which of
    several tokens of exactly equal probability straddling the cut are kept is left open by the engine (its
    sort is not stable); this reference keeps the lower index, and the tests use logits without such ties.
"""

from __future__ import annotations

import numpy as np


def reference_probs(logits: object, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The next-token distribution [V] (float64) for one row of logits, from the definitions above.

    `logits` is anything `np.asarray` takes (a torch tensor is converted through `.tolist()`, so that no
    torch arithmetic is involved).
    """
    z = np.asarray(logits.tolist() if hasattr(logits, "tolist") else logits, dtype=np.float64)
    if z.ndim != 1:
        raise ValueError(f"one row of logits expected, got shape {z.shape}")
    v = z.shape[0]
    if temperature == 0:
        out = np.zeros(v)
        out[int(np.argmax(z))] = 1.0  # numpy's argmax also returns the first maximal index
        return out
    z = z / temperature
    keep = np.isfinite(z)
    if top_k and top_k < v:
        kth = np.sort(z)[::-1][top_k - 1]  # the k-th largest scaled logit
        keep &= z >= kth
    w = np.zeros(v)
    w[keep] = np.exp(z[keep] - z[keep].max())
    w /= w.sum()
    if top_p < 1.0:
        order = sorted(range(v), key=lambda i: -w[i])  # stable: among equal probabilities, lower index first
        mass_before = 0.0
        kept = np.zeros(v, dtype=bool)
        for i in order:
            if mass_before >= top_p:
                break
            kept[i] = True
            mass_before += w[i]
        w = np.where(kept, w, 0.0)
        w /= w.sum()
    return w


def top_p_margin(logits: object, temperature: float, top_k: int, top_p: float) -> float:
    """How far `top_p` is from every cumulative mass of the sorted (top-k) distribution.

    Where a cumulative mass is within float32 rounding of p, float32 and float64 may keep different
    prefixes; a test comparing the two must pick cases with a clear margin (it asserts this, rather than
    hoping).
    """
    w = reference_probs(logits, temperature, top_k, 1.0)
    cum = np.cumsum(np.sort(w)[::-1])
    return float(np.min(np.abs(cum - top_p)))
