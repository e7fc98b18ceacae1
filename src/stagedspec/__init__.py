"""stagedspec: exact staged speculative decoding for small-batch LLM inference."""

from stagedspec.errors import StagedSpecError

__all__ = ["StagedSpecError", "__version__"]
__version__ = "0.1.1"
