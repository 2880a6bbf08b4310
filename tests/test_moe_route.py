"""The MoE routing and combination kernels (kernels/moe_route.py), their CUDA and Metal sources
run on the CPU thread by thread (tests/cuda_emulation.py): against the ops references, each
row alone as among others, and mistakes that the tests catch."""

from __future__ import annotations

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import numpy as np
import pytest

from mtpcli import kernels
from mtpcli.kernels import moe_route as mr

pytestmark = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")


def _bits16(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _route(logits: mx.array, experts: int, k: int, normalize: bool, metal: bool = False,
           source: str | None = None, shared_slot: bool = False):  # fmt: skip
    """The emulated routing of bf16 logits [R, W] -> (indices, scores) as float arrays."""
    rows = logits.shape[0]
    warps = 4
    out = cuda_emulation.run(
        source or mr.route_source(metal),
        {"logits": _bits16(logits)},
        {"inds": (rows, k + shared_slot), "scores": (rows, k)},
        {"InT": "__nv_bfloat16", "E": experts, "EPL": -(-experts // 32), "KS": k,
         "SLOTS": k + shared_slot, "NORM": int(normalize), "WARPS": warps},
        grid=(32 * warps * -(-rows // warps), 1, 1),
        threadgroup=(32 * warps, 1, 1),
        types={"logits": "InT"},
    )  # fmt: skip
    return out["inds"].astype(np.int64), out["scores"]


def _combine(y, scores, shared, logits, h, metal: bool = False, source: str | None = None):
    n = h.size
    out = cuda_emulation.run(
        source or mr.combine_source(metal),
        {"y": _bits16(y), "scores": _bits16(scores), "shared": _bits16(shared),
         "logits": _bits16(logits), "h": _bits16(h)},
        {"out": h.shape},
        {"InT": "__nv_bfloat16", "KS": scores.shape[-1], "SLOTS": y.shape[-2]},
        grid=(256 * -(-n // 256), 1, 1),
        threadgroup=(256, 1, 1),
        types=dict.fromkeys(("y", "scores", "shared", "logits", "h"), "InT"),
    )  # fmt: skip
    return out["out"]


def _logits(rows: int, experts: int, seed: int) -> mx.array:
    return (mx.random.normal((rows, experts + 1), key=mx.random.key(seed)) * 2).astype(
        mx.bfloat16)  # fmt: skip


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("experts,k,normalize", [(64, 4, True), (48, 3, False), (256, 8, True)])
def test_routing_takes_the_k_largest_gates_and_scores_them_as_reference(metal, experts, k,
                                                                          normalize):  # fmt: skip
    logits = _logits(6, experts, seed=experts + k)
    inds, scores = _route(logits, experts, k, normalize, metal)
    want_inds, want_scores = mr.route_ops(logits, experts, k, normalize)
    gates = np.array(mx.softmax(logits[:, :experts], axis=-1, precise=True).astype(mx.float32))
    for r in range(6):
        assert len(set(inds[r])) == k and all(0 <= i < experts for i in inds[r])
        assert np.all(np.diff(gates[r, inds[r]]) <= 0)  # largest first
        np.testing.assert_array_equal(np.sort(gates[r, inds[r]]),
                                      np.sort(gates[r, np.array(want_inds[r])]))  # fmt: skip
    np.testing.assert_allclose(np.sort(scores, -1),
                               np.sort(np.array(want_scores.astype(mx.float32)), -1),
                               rtol=1e-2, atol=1e-4)  # fmt: skip
    one_inds, one_scores = _route(logits[2:3], experts, k, normalize, metal)
    assert np.array_equal(one_inds[0], inds[2]) and np.array_equal(one_scores[0], scores[2])


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_combination_matches_the_reference_and_each_row_alone(metal):
    k, hid, rows = 4, 96, 5
    keys = mx.random.split(mx.random.key(9), 5)
    y = mx.random.normal((rows, k, hid), key=keys[0]).astype(mx.bfloat16)
    scores = mx.softmax(mx.random.normal((rows, k), key=keys[1]), axis=-1).astype(mx.bfloat16)
    shared = mx.random.normal((rows, hid), key=keys[2]).astype(mx.bfloat16)
    logits = mx.random.normal((rows, 9), key=keys[3]).astype(mx.bfloat16)
    h = mx.random.normal((rows, hid), key=keys[4]).astype(mx.bfloat16)
    got = _combine(y, scores, shared, logits, h, metal)
    want = np.array(mr.combine_ops(y, scores, shared, logits, h).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)
    one = _combine(y[3:4], scores[3:4], shared[3:4], logits[3:4], h[3:4], metal)
    assert np.array_equal(one[0], got[3])


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_the_shared_expert_as_a_last_slot_changes_nothing_else(metal):
    """The shared expert stacked as expert E: the routing gives every row a last index E and
    the same k; the combination reading its output from y's last slot gives the bits it gives
    with the output passed apart (and the reference's values). Mutation: the slot read one
    place early (a routed expert's output taken for the shared one) changes the output."""
    experts, k, hid, rows = 64, 4, 96, 5
    logits = _logits(rows, experts, seed=21)
    inds, scores = _route(logits, experts, k, True, metal)
    inds_s, scores_s = _route(logits, experts, k, True, metal, shared_slot=True)
    assert np.array_equal(inds_s[:, :k], inds) and np.all(inds_s[:, k] == experts)
    assert np.array_equal(scores_s, scores)
    keys = mx.random.split(mx.random.key(5), 3)
    y = mx.random.normal((rows, k, hid), key=keys[0]).astype(mx.bfloat16)
    shared = mx.random.normal((rows, hid), key=keys[1]).astype(mx.bfloat16)
    h = mx.random.normal((rows, hid), key=keys[2]).astype(mx.bfloat16)
    sc = mx.array(scores).astype(mx.bfloat16)
    stacked = mx.concatenate([y, shared[:, None]], axis=1)  # [rows, k + 1, hid]
    apart = _combine(y, sc, shared, logits, h, metal)
    got = _combine(stacked, sc, h, logits, h, metal)
    assert np.array_equal(got, apart)
    want = np.array(mr.combine_ops(stacked, sc, h, logits, h).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)
    text = mr.combine_source(metal)
    early = "y[(r * SLOTS + KS) * H + n]"
    assert text.count(early) == 1
    bad = _combine(stacked, sc, h, logits, h, metal,
                   source=text.replace(early, "y[(r * SLOTS + KS - 1) * H + n]"))  # fmt: skip
    assert np.abs(bad - got).max() > 0.05


@pytest.mark.parametrize("mistake,normalize", [
    (("if (lane + 32 * i == at) v[i] = -2.0f;", ""), True),  # a taken expert taken again
    (("NORM ? picked[s] / norm : picked[s]", "picked[s]"), True),  # never normalised
    (("v[i] / sum", "v[i]"), False),  # no softmax division (normalising would cancel it)
])  # fmt: skip
def test_routing_tests_catch_a_broken_kernel(mistake, normalize):
    logits = _logits(4, 64, seed=3)
    text = mr.route_source(False)
    assert text.count(mistake[0]) == 1
    good = _route(logits, 64, 4, normalize)
    bad = _route(logits, 64, 4, normalize, source=text.replace(*mistake))
    assert not (np.array_equal(bad[0], good[0]) and np.allclose(bad[1], good[1], rtol=1e-2))


@pytest.mark.parametrize("mistake", [
    ("logits[r * W + W - 1]", "logits[r * W]"),  # the gate logit read from the router's columns
    ("static_cast<float>(h[i]) + t", "t"),  # the residual dropped
])  # fmt: skip
def test_combination_tests_catch_a_broken_kernel(mistake):
    keys = mx.random.split(mx.random.key(1), 5)
    y = mx.random.normal((2, 3, 32), key=keys[0]).astype(mx.bfloat16)
    scores = mx.random.uniform(shape=(2, 3), key=keys[1]).astype(mx.bfloat16)
    shared, h = (mx.random.normal((2, 32), key=kk).astype(mx.bfloat16) for kk in keys[2:4])
    logits = mx.random.normal((2, 5), key=keys[4]).astype(mx.bfloat16) * 3
    text = mr.combine_source(False)
    assert text.count(mistake[0]) == 1
    good = _combine(y, scores, shared, logits, h)
    bad = _combine(y, scores, shared, logits, h, source=text.replace(*mistake))
    assert np.abs(bad - good).max() > 0.1


@pytest.mark.skipif(not kernels.available("cuda"),
                    reason="needs MLX's CUDA backend")  # fmt: skip
@pytest.mark.parametrize("experts,k,normalize", [(256, 8, True), (8, 2, True), (64, 4, False)])
def test_cuda_kernels_pass_their_self_check(experts, k, normalize):
    assert mr._self_check(mx.bfloat16, experts, k, normalize) is None
