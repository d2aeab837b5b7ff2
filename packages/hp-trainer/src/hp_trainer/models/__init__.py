"""Models in single-device code: the dense decoder family (Llama 3, Qwen3), their published
configurations, and HuggingFace checkpoint loading/saving."""

from ._config import CONFIGS, TransformerConfig, get_config
from ._hf import from_pretrained, hf_name, our_name, save_pretrained
from ._loss import linear_cross_entropy
from ._transformer import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock

__all__ = [
    "CONFIGS",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "from_pretrained",
    "get_config",
    "hf_name",
    "linear_cross_entropy",
    "our_name",
    "save_pretrained",
]
