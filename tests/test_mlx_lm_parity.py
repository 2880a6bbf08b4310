"""Our classic decoder gives mlx-lm's greedy tokens on the same checkpoint and prompt ids (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from mtpcli.config import load_config
from mtpcli.engine.classic import generate_classic
from mtpcli.models.qwen3_5 import load_target
from mtpcli.options import Options

PROMPTS = [[7], [72, 101, 108, 108, 111, 32, 119], [(i * 13) % 250 for i in range(90)]]


# mlx-lm cannot run an unquantized (bf16) MoE on MLX's CPU backend at all (gather_mm is
# float32-only there); our loader upcasts those experts, so that pair has no mlx-lm reference.
@pytest.mark.parametrize(
    "moe,bits,layout,predictable,qmm",
    [(False, None, "mlx", None, "auto"), (False, 4, "mlx", None, "auto"),
     (False, 8, "mlx", None, "auto"), (True, 4, "mlx", None, "auto"),
     (False, None, "raw", None, "auto"), (False, 4, "mlx", 0.45, "auto"),
     (False, 4, "mlx", None, "ours")],
    ids=["bf16", "4bit", "8bit", "moe-4bit", "raw-bf16", "4bit-predictable", "4bit-our-layers"],
)  # fmt: skip
@pytest.mark.parametrize("kernel_mode", ["auto", "ops"])
def test_classic_tokens_equal_mlx_lm_greedy(ckpts, monkeypatch, moe, bits, layout, predictable,
                                            qmm, kernel_mode):  # fmt: skip
    """qmm "ours": our product's layers installed, whose reference path on the CPU (the
    residual added after the product, as MLX adds it) must still give mlx-lm's tokens."""
    path = ckpts.target(moe=moe, bits=bits, layout=layout, predictable=predictable, seed=3)
    theirs_model, _ = load_model(path)
    ours = load_target(path, load_config(path), Options(kernels=kernel_mode, qmm=qmm))
    for prompt in PROMPTS:
        want = [
            int(t)
            for t, _ in generate_step(
                mx.array(prompt), theirs_model, max_tokens=40, sampler=make_sampler(0.0)
            )
        ]
        got = list(generate_classic(ours, prompt, max_tokens=40))
        assert got == want, prompt[:5]
