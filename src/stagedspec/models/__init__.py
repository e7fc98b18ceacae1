"""Native PyTorch decoder models (Llama family, GPT-2) and their loaders."""

from stagedspec.models.config import ModelConfig
from stagedspec.models.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
