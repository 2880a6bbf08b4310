"""Temperature-0 exactness on MLX's CUDA backend, at the real head dimensions (Dk = Dv = 128,
head_dim 256), through the native gated-delta kernel. Skips cleanly without CUDA; the CPU runs
the same contract in test_exactness.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli import kernels
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.fixtures import tiny_text_config, write_drafter, write_target
from mtpcli.loading import load_pair
from mtpcli.options import Options
from mtpcli.stats import GenerationStats

pytestmark = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")

MID = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256,
       "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
       "linear_value_head_dim": 128, "intermediate_size": 512, "vocab_size": 512}  # fmt: skip
PROMPTS = [[7], [72, 101, 108, 108, 111], [(i * 37) % 250 for i in range(70)]]


@pytest.fixture(
    scope="module", params=[(None, "mlx"), (4, "mlx"), (4, "ours")],
    ids=["bf16", "4bit", "4bit-our-qmm"],
)  # fmt: skip
def pair(request, tmp_path_factory):
    bits, qmm = request.param
    root = tmp_path_factory.mktemp(f"cuda-{bits}")
    text = tiny_text_config(**MID)
    t = write_target(root / "t", text, bits=bits, predictable=0.45, group_size=64)
    d = write_drafter(root / "d", text, predictable=0.45)
    return load_pair(str(t), str(d), options=Options(qmm=qmm))


def test_native_kernel_is_in_use(pair):
    kernels.reset_verdicts()
    list(generate_classic(pair.target, [1, 2, 3], max_tokens=2))
    verdicts = kernels._verdicts
    assert verdicts and all(verdicts.values())
    ours = type(pair.target.embed_tokens).__name__.startswith("Kernel")
    assert any(name == "quantized_matmul" for name, _ in verdicts) == ours


def test_quantized_verify_runs_its_matmuls_batched(pair):
    # Every row of a block is the decode row bitwise, by construction with our kernel and as
    # measured for MLX's own 4-bit product up to 7 rows, so the row policy settles on batched
    # layer functions (a gated-delta layer with its MLP; attention's projections and MLP) and
    # heads for every class it probed.
    if pair.target.config.quantization is None:
        pytest.skip("bf16 target: its dense matmuls are not row-invariant on CUDA")
    policy = pair.target.policy
    policy.verdicts.clear()
    policy._seen.clear()
    for _ in range(2):
        list(generate_mtp(pair.target, pair.drafter, PROMPTS[2], block_size=3, max_tokens=24))

    def op_class(sig) -> tuple:  # a layer function's key: its signature, or (it, part)
        return policy.op_class(sig if isinstance(sig, int) else sig[0])

    layers = {k: v for k, v in policy.verdicts.items() if "DecoderLayer" in op_class(k[0])[0]}
    assert layers and all(policy.verdicts.values())


@pytest.mark.parametrize("block", [2, 3, 4, 8])
def test_mtp_equals_classic_on_cuda(pair, block):
    ahead = 0
    for prompt in PROMPTS:
        want = list(generate_classic(pair.target, prompt, max_tokens=40))
        stats = GenerationStats()
        got = list(generate_mtp(pair.target, pair.drafter, prompt, block_size=block, max_tokens=40,
                                stats=stats))  # fmt: skip
        assert got == want
        ahead += stats.mtp.ahead
    # with our product every verify becomes a graph, and its rounds are built ahead
    assert ahead > 0 or pair.target.options.qmm != "ours"


def test_block_forward_equals_single_steps_on_cuda(pair):
    target = pair.target
    prompt, block = mx.array([[5, 6, 7, 8]]), mx.array([[11, 12, 13, 14]])
    ca, cb = target.make_cache(), target.make_cache()
    target.prefill(prompt, ca)
    target.prefill(prompt, cb)
    out = target.forward(block, ca, verify=True)
    lb = target.lm_head(out.hidden, exact=True)
    singles = [target.lm_head(target.forward(block[:, t : t + 1], cb).hidden) for t in range(4)]
    assert mx.array_equal(lb, mx.concatenate(singles, axis=1)).item()
