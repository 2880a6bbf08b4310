"""Temperature 0: MTP tokens are identical to classic tokens. The contract MTP rests on."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from mtpcli import kernels
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.engine.sampling import positions
from mtpcli.loading import load_pair
from mtpcli.models import qwen3_5 as target_mod
from mtpcli.models import row_policy
from mtpcli.options import Options
from mtpcli.stats import GenerationStats

PROMPTS = [
    [7],  # one token
    [72, 101, 108, 108, 111],
    [200, 3, 9, 9, 41],
    list(range(32, 96)),
    [10] * 12,
    [258, 257, 65, 66],
    [(i * 37) % 250 for i in range(330)],  # longer than the KV cache's 256-step growth
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]
BLOCKS = [2, 3, 4, 6, 8]


def _retrace(target) -> None:
    """Fresh layer functions: the next passes trace what the model code now calls."""
    target.retrace()


def _classic(loaded, prompt, n):
    return list(generate_classic(loaded.target, prompt, max_tokens=n))


def _mtp(loaded, prompt, n, block, stats=None):
    return list(
        generate_mtp(
            loaded.target, loaded.drafter, prompt, block_size=block, max_tokens=n, stats=stats
        )
    )


@pytest.mark.parametrize(
    "moe,bits",
    [(False, None), (False, 4), (True, None), (True, 4)],
    ids=["bf16", "4bit", "moe-bf16", "moe-4bit"],
)
@pytest.mark.parametrize("drafter", ["predictable", "random"])
def test_mtp_equals_classic(load, moe, bits, drafter):
    loaded = load(moe=moe, bits=bits, drafter=drafter)
    # A random drafter's rounds emit one token each, every one its deepest rollback: 24 tokens
    # are 24 of them a block, and half the CPU time of 48 (no cache boundary lies between).
    # Its deepest rollbacks at blocks 2, 4 and 8 stand for the others (every block size
    # meets the predictable drafter's partial acceptances).
    n, blocks = (24, [2, 4, 8]) if drafter == "random" else (48, BLOCKS)
    hist_by_block = {b: [0] * b for b in blocks}
    # Six of the prompts: the other short ones stand for [10] * 12 (also in the long-generation
    # test below) and 1..11; the 330-token one crosses the KV cache's growth.
    for prompt in PROMPTS[:4] + PROMPTS[5:7]:
        want = _classic(loaded, prompt, n)
        assert len(want) == n
        for block in blocks:
            stats = GenerationStats()
            got = _mtp(loaded, prompt, n, block, stats)
            assert got == want, f"prompt {prompt[:6]}... block {block}"
            hist = stats.mtp.accept_histogram
            hist_by_block[block] = [a + b for a, b in zip(hist_by_block[block], hist, strict=True)]
    if drafter == "random":
        # Every draft of a random drafter is rejected (almost always): the rollback runs
        # its deepest case every round.
        assert all(h[0] > 0.8 * sum(h) for h in hist_by_block.values())
    else:
        for block in (2, 3, 4):  # partial acceptance of every length occurred
            assert all(c > 0 for c in hist_by_block[block]), (block, hist_by_block[block])


@pytest.fixture(scope="module")
def seed1_pair(ckpts):
    """The predictable pair with the seed-1 target: its token map's cycles give runs of every
    length up to 7 (seed 0's never give 6 accepted of 7 drafts)."""
    return load_pair(str(ckpts.target(seed=1)), str(ckpts.drafter()))


@pytest.fixture(scope="module")
def seed1_classic(seed1_pair):
    """The seed-1 pair's classic tokens, 256 after each prompt (made once for every block)."""
    return {tuple(p): _classic(seed1_pair, p, 256) for p in PROMPTS[:6]}


@pytest.mark.parametrize("block", BLOCKS)
def test_long_generation_all_accept_counts(seed1_pair, seed1_classic, block):
    """256 tokens over several prompts; MTP == classic, and (on the CPU) every accept count
    0..k occurs. The tokens, and so the accept counts, depend on the backend's arithmetic: on
    the H200 one accept count of block 8 never occurred with this model (MTP == classic held)."""
    loaded = seed1_pair
    hist = [0] * block
    for prompt in PROMPTS[:6]:
        want = seed1_classic[tuple(prompt)]
        stats = GenerationStats()
        assert _mtp(loaded, prompt, 256, block, stats) == want
        hist = [a + b for a, b in zip(hist, stats.mtp.accept_histogram, strict=True)]
    if kernels.backend() == "cpu":
        assert all(c > 0 for c in hist), hist


def _assert_same_caches(ca, cb):
    for a, b in zip(ca, cb, strict=True):
        if isinstance(a, ArraysCache):  # conv window, recurrent state
            pairs = list(zip(a.cache, b.cache, strict=True))
        else:
            assert a.offset == b.offset
            pairs = [(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]),
                     (a.values[..., : a.offset, :], b.values[..., : b.offset, :])]  # fmt: skip
        for x, y in pairs:
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()


def test_block_forward_equals_single_steps(load):
    """A verify forward of T positions == T one-position forwards, bitwise, logits and caches."""
    loaded = load(bits=4)
    target = loaded.target
    prompt = mx.array([[5, 6, 7, 8, 9, 10]])
    block = mx.array([[11, 12, 13, 14, 15]])
    ca, cb = target.make_cache(), target.make_cache()
    target.prefill(prompt, ca)
    target.prefill(prompt, cb)
    out = target.forward(block, ca, verify=True)
    logits_block = target.lm_head(out.hidden, exact=True)
    singles = []
    for t in range(block.shape[1]):
        singles.append(target.lm_head(target.forward(block[:, t : t + 1], cb).hidden))
    assert mx.array_equal(logits_block, mx.concatenate(singles, axis=1)).item()
    _assert_same_caches(ca, cb)


# The rollback's restores (KV trim, conv window, recurrent state) on a dense and a MoE pair.
ROLLBACK_PAIRS = {"dense-bf16": {}, "moe-4bit": {"moe": True, "bits": 4}}
ROLLBACK_PARTS = ["restore_state", "restore_conv", "trim_kv"]


def _rollback_equals_steps(target, n_keep: int) -> bool:
    """Verify a 4-token block and roll back to ``n_keep``: do the caches equal those of
    ``n_keep`` decode steps, bitwise?"""
    prompt, block = mx.array([[3, 1, 4, 1, 5]]), mx.array([[9, 2, 6, 5]])
    ca, cb = target.make_cache(), target.make_cache()
    target.prefill(prompt, ca)
    target.prefill(prompt, cb)
    out = target.forward(block, ca, verify=True)
    target_mod.rollback(ca, out.traces, n_keep, block.shape[1])
    for t in range(n_keep):
        target.forward(block[:, t : t + 1], cb)
    try:
        _assert_same_caches(ca, cb)
        return True
    except AssertionError:
        return False


@pytest.mark.parametrize("pair", ROLLBACK_PAIRS)
def test_rollback_restores_exact_state(load, pair):
    """After verify + rollback to n, the caches equal those of n decode steps."""
    target = load(**ROLLBACK_PAIRS[pair]).target
    assert all(_rollback_equals_steps(target, n) for n in range(1, 5))


def _primitives(tmp_path, *arrays) -> set[str]:
    """The primitives of the graph that makes ``arrays`` (from MLX's DOT export)."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    return set(re.findall(r'label ="(\w+)", shape=rectangle', path.read_text()))


def test_rollback_and_logits_are_views_not_copies(load, tmp_path):
    """Integer indexing is a gather in MLX: on the H200 the rollback's restored states cost
    20 us a layer through it. The rollback and the engine's logits picks must stay views."""
    target = load().target
    cache = target.make_cache()
    target.prefill(mx.array([[3, 1, 4, 1, 5]]), cache)
    out = target.forward(mx.array([[9, 2, 6]]), cache, verify=True)
    mx.eval(out.hidden, out.traces)
    target_mod.rollback(cache, out.traces, 2, 3)
    restored = [c[1] for c in cache if isinstance(c, ArraysCache)]
    assert restored and "Gather" not in _primitives(tmp_path, *restored)
    logits = mx.random.normal((1, 3, 11))
    mx.eval(logits)
    assert mx.array_equal(positions(logits), logits[0]).item()
    assert "Gather" not in _primitives(tmp_path, positions(logits), logits[0, -1])
    assert "Gather" in _primitives(tmp_path, logits[0])  # the check can fail


def test_row_policy_catches_an_op_that_is_not_row_invariant(load, monkeypatch):
    """An op whose batched rows differ from single rows is run row by row in a verify. (The
    4-bit model: on a GPU the bf16 model's layers are never probed, they always go row by row.)"""
    from mtpcli.models.qwen3_5 import RowPolicy

    target = load(bits=4).target
    assert target.layers[0].is_linear
    # Layer 0's out projection: called in every configuration (its MLP is not, where the MLP's
    # products are fused into one launch).
    out_proj = target.layers[0].linear_attn.out_proj
    original = target_mod.linear_add

    def skewed(layer, x, residual):  # switches with the row count
        out = original(layer, x, residual)
        return out + 1e-2 * (x.shape[1] > 1) if layer is out_proj else out

    monkeypatch.setattr(target_mod, "linear_add", skewed)
    monkeypatch.setattr(target, "policy", RowPolicy())
    _retrace(target)  # the compiled layer functions were traced without the skew
    prompt = PROMPTS[3]
    want = _classic(load(bits=4), prompt, 48)
    assert _mtp(load(bits=4), prompt, 48, 4) == want
    # The policy decides per layer function (a gated-delta layer with its MLP, compiled).
    verdicts = target.policy.verdicts
    layer_class = type(target.layers[0]).__name__
    assert any(
        not ok
        for key, ok in verdicts.items()
        if isinstance(key[0], int) and target.policy.op_class(key[0])[0] == layer_class
    )
    # Without the policy (batched everywhere), the same op breaks exactness.
    monkeypatch.setattr(
        RowPolicy, "choose", lambda self, key, batched, single, probe=True: batched()
    )
    assert _mtp(load(bits=4), prompt, 48, 4) != want
    monkeypatch.undo()
    _retrace(target)


def test_routed_layers_go_position_by_position_in_a_gpu_verify(load, monkeypatch):
    """Which rows of a verify share an expert's product changes from block to block, so on a
    GPU a MoE layer can pass the policy's probes and differ in a later block (seen on the
    H200). There a verify never batches routed layers: even probes that pass by luck (all of
    them, here) leave MTP equal to classic, while probing them as other layers breaks it."""
    from types import SimpleNamespace

    from mtpcli.models.qwen3_5 import Qwen35Target, RowPolicy

    loaded = load(moe=True)
    mlx_qmm = Options(qmm="mlx")
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    target = Qwen35Target(loaded.target.model, loaded.target.config, mlx_qmm, fuse=False)
    monkeypatch.setattr(kernels, "backend", lambda: "cpu")
    on_cpu = Qwen35Target(loaded.target.model, loaded.target.config, mlx_qmm, fuse=False)
    monkeypatch.undo()
    assert not any(on_cpu.routed_on_gpu)
    _classic(SimpleNamespace(target=on_cpu), PROMPTS[1], 4)
    assert on_cpu.functions.compiled_keys()
    assert target.routed_on_gpu == [True] * len(target.layers)
    still_exact = _skewed_blocks_pass_every_probe(monkeypatch, target, target.layers[0].mlp,
                                                  loaded.drafter)  # fmt: skip
    assert not target.functions.compiled_keys()  # every layer's MLP is routed here
    monkeypatch.setattr(target, "policy", RowPolicy())
    monkeypatch.setattr(target, "routed_on_gpu", [False] * len(target.layers))
    monkeypatch.setattr(target, "unprobed", [False] * len(target.layers))
    assert not still_exact()
    monkeypatch.undo()


def _skewed_blocks_pass_every_probe(monkeypatch, target, module, drafter):
    """Skew ``module``'s rows whenever it meets a block (T > 1) and let every probe pass: MTP
    must still equal classic (asserted here). Returns a rerun of that comparison."""
    from types import SimpleNamespace

    original = type(module).__call__

    def skewed(self, x):  # rows of a block differ from single rows
        out = original(self, x)
        return out + 1e-2 * (x.shape[1] > 1) if self is module else out

    monkeypatch.setattr(type(module), "__call__", skewed)
    monkeypatch.setattr(row_policy, "equal", lambda a, b: True)  # every probe passes
    _retrace(target)
    pair = SimpleNamespace(target=target, drafter=drafter)
    want = _classic(pair, PROMPTS[3], 48)
    assert _mtp(pair, PROMPTS[3], 48, 4) == want
    return lambda: _mtp(pair, PROMPTS[3], 48, 4) == want


def test_dense_layers_go_position_by_position_in_a_gpu_verify(load, monkeypatch):
    """A layer (or head) with an unquantized product is never probed on a GPU: MLX's bf16
    matmuls are not row-invariant there, and on the H200 three probes of the bf16 test model
    passed and a later block differed. With every probe passing and a dense product's block
    rows skewed, MTP still equals classic; probing those layers again breaks it."""
    from mtpcli.models.qwen3_5 import Qwen35Target, RowPolicy

    loaded, quantized = load(), load(bits=4)
    mlx_qmm = Options(qmm="mlx")
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    target = Qwen35Target(loaded.target.model, loaded.target.config, mlx_qmm, fuse=False)
    q4 = Qwen35Target(quantized.target.model, quantized.target.config, mlx_qmm, fuse=False)
    monkeypatch.undo()
    assert target.unprobed == [True] * len(target.layers) and target.head_unprobed
    assert not any(q4.unprobed) and not q4.head_unprobed
    down = target.layers[0].mlp.down_proj
    still_exact = _skewed_blocks_pass_every_probe(monkeypatch, target, down, loaded.drafter)
    monkeypatch.setattr(target, "policy", RowPolicy())
    monkeypatch.setattr(target, "unprobed", [False] * len(target.layers))
    assert not still_exact()
    monkeypatch.undo()


@pytest.mark.parametrize("pair", ROLLBACK_PAIRS)
@pytest.mark.parametrize("fault", ROLLBACK_PARTS)
def test_broken_rollback_breaks_exactness(load, monkeypatch, pair, fault):
    """Mutation test: with any one restore disabled, the rolled-back caches differ from the
    decode steps' at every partial acceptance, and MTP's tokens diverge from classic's. A
    drafter whose drafts are rejected makes every round roll back its whole block."""
    loaded = load(**ROLLBACK_PAIRS[pair], drafter="random")
    runs = [(i, block) for i in (1, 2, 3) for block in (3, 4)]
    wants = {i: _classic(loaded, PROMPTS[i], 48) for i in (1, 2, 3)}
    assert all(_mtp(loaded, PROMPTS[i], 48, block) == wants[i] for i, block in runs)
    monkeypatch.setattr(target_mod, fault, lambda *a, **k: None)
    assert not any(_rollback_equals_steps(loaded.target, n) for n in range(1, 4)), fault
    diverged = [(i, b) for i, b in runs if _mtp(loaded, PROMPTS[i], 48, b) != wants[i]]
    assert diverged, f"disabling {fault} went unnoticed by the tokens"


def test_the_folded_conv_kernel_runs_every_gated_delta_layer(load, monkeypatch, pretend_gpu):
    """Where the gated-delta kernel makes the convolution itself (a GPU), decode steps and
    verify blocks run it, and their windows and states carry on from it: here a stand-in
    computing the reference, so MTP still equals classic."""
    from mtpcli.kernels import gated_delta as gd

    loaded = load(bits=4)
    calls = []

    def native(qkv, *args, keep_states=False):
        calls.append((qkv.shape[1], keep_states))
        return gd.gated_delta_conv_ops(qkv, *args, keep_states=keep_states)

    kernels.reset_verdicts()
    pretend_gpu(gd, "gated_delta_conv_native", native)
    policy = target_mod.RowPolicy()  # blocks compared with single steps afresh
    monkeypatch.setattr(loaded.target, "policy", policy)
    try:
        prompt = PROMPTS[1]
        assert _mtp(loaded, prompt, 24, 4) == _classic(loaded, prompt, 24)
        # traced (or run op by op) for a decode step and a 4-token verify block
        assert (1, False) in calls and (4, True) in calls
        # and the blocks' outputs, the conv's included, equalled the single steps': they ran
        linear = {policy.signature(ly) for ly in loaded.target.layers if ly.is_linear}
        verdicts = [
            ok for key, ok in policy.verdicts.items() if key[:2] in {(s, 4) for s in linear}
        ]
        assert verdicts and all(verdicts)
    finally:
        monkeypatch.undo()
        kernels.reset_verdicts()
        _retrace(loaded.target)  # the layer functions without the stand-in


def test_a_verify_submitted_in_parts_still_equals_classic(load, monkeypatch):
    """With ``submit_every`` a verify block's hidden state is submitted every few layers while
    the rest is built: each verify adds a submission a layer at 1, and MTP still equals
    classic. Classic's decode steps are not submitted in parts."""
    from mtpcli import options

    loaded = load(bits=4)
    prompt = PROMPTS[2]
    want = _classic(loaded, prompt, 24)
    calls, real = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: calls.append(1) or real(*a))

    def submissions() -> int:
        calls.clear()
        assert _mtp(loaded, prompt, 24, 3) == want
        return len(calls)

    base = submissions()
    monkeypatch.setattr(loaded.target, "submit_every", 1)
    assert submissions() - base >= len(loaded.target.layers)  # a verify's layers, at least
    calls.clear()
    assert _classic(loaded, prompt, 24) == want
    assert len(calls) <= 24  # a submission a step at most: none in parts
    monkeypatch.setattr(options, "backend", lambda: "cpu")
    assert Options().layers_a_submit == 0  # the CPU: its compute hides the overlap
    monkeypatch.setattr(options, "backend", lambda: "cuda")
    assert Options().layers_a_submit == options.SUBMIT_EVERY_GPU == 8  # measured on a GPU
    assert Options(submit_every=0).layers_a_submit == 0
    assert Options(submit_every=2).layers_a_submit == 2


def test_eos_and_max_tokens_stop_both_engines(load):
    loaded = load()
    prompt = PROMPTS[1]
    full = _classic(loaded, prompt, 40)
    eos = full[17]
    first = full.index(eos)
    c = list(generate_classic(loaded.target, prompt, max_tokens=40, eos_ids=[eos]))
    m = list(
        generate_mtp(
            loaded.target, loaded.drafter, prompt, block_size=4, max_tokens=40, eos_ids=[eos]
        )
    )
    assert c == m == full[:first]
    for n in (1, 2, 5):
        assert _mtp(loaded, prompt, n, 4) == full[:n]


def test_op_classes_are_numbered_once_and_read_back():
    """``RowPolicy.signature``: modules of one op class share a number, others get their own,
    and ``op_class`` gives the class back."""
    import mlx.nn as nn

    from mtpcli.models.qwen3_5 import RowPolicy

    policy = RowPolicy()
    a, b, c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
    assert policy.signature(a) == policy.signature(b) != policy.signature(c)
    assert policy.signature(a) == policy.signature(a)  # cached
    name, bits, shapes = policy.op_class(policy.signature(c))
    assert (name, bits) == ("Linear", None) and ("weight", (4, 8), "mlx.core.float32") in shapes
