"""mtp: multi-token-prediction speculative decoding for Qwen3.5-family models on MLX.

The Python API::

    from mtpcli import load_pair, generate

    pair = load_pair("mlx-community/Qwen3.8-27B-4bit", "mlx-community/Qwen3.8-27B-MTP-bf16")
    result = generate(pair, "Write a haiku about rivers.", max_tokens=64)
    print(result.text, result.stats.generation_tps)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["GenerateResult", "Loaded", "MtpError", "Options", "SamplingParams", "generate",
           "load_pair"]  # fmt: skip

# Where each public name lives; imported on first use, so that ``mtp --help`` and the error
# types do not load MLX.
_PUBLIC = {
    "load_pair": "loading", "Loaded": "loading", "generate": "generation",
    "GenerateResult": "generation", "Options": "options", "SamplingParams": "engine.sampling",
    "MtpError": "errors",
}  # fmt: skip

if TYPE_CHECKING:
    from .engine.sampling import SamplingParams
    from .errors import MtpError
    from .generation import GenerateResult, generate
    from .loading import Loaded, load_pair
    from .options import Options


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
