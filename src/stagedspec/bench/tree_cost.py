"""Cost of one oracle forward as a function of the number of tree nodes (`bench-engine --tree-cost`).

The measurement lives in the core (`stagedspec.costs`), where `--method auto`
and the adaptive tree budget use it; this module keeps the bench's name for it.
"""

from stagedspec.profiling import forward_cost_curve, print_cost_curve

__all__ = ["forward_cost_curve", "print_cost_curve"]
