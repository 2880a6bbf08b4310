"""mtp: multi-token-prediction speculative decoding for Qwen3.5-family models on MLX."""

__version__ = "0.1.0"
