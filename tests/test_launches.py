"""The launch counter: node kinds of a known graph, the CUDA structure built on the CPU, and
the counts of a decode step and a round against what the layers must launch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli import kernels, launches, synthetic
from mtpcli.options import Options


def test_graph_counts_each_node_once_and_views_launch_nothing():
    a, b = mx.ones((4, 4)), mx.ones((4, 4))
    mx.eval(a, b)
    s = a + b  # shared by both outputs
    out = [(s * s).reshape(16), s.T]
    c = launches.graph(out)
    assert c.kinds == {"Add": 1, "Multiply": 1, "Reshape": 1, "Transpose": 1}
    assert (c.nodes, c.launches) == (4, 2)
    assert (c + c).kinds["Add"] == 2


def test_structure_of_restores_mlx_and_kernels_even_after_an_error():
    before = (mx.fast.rms_norm, mx.dequantize, kernels.backend())
    with pytest.raises(RuntimeError), launches.structure_of("cuda"):
        assert kernels.backend() == "cuda" and kernels.available("cuda")
        assert mx.fast.rms_norm is not before[0]
        raise RuntimeError("inside")
    assert (mx.fast.rms_norm, mx.dequantize, kernels.backend()) == before
    with pytest.raises(ValueError, match="graph_as"):
        with kernels.graph_as("tpu"):
            pass


def test_a_fused_op_is_one_node_with_its_shape_under_the_cuda_structure():
    x, w = mx.ones((2, 3, 64), mx.bfloat16), mx.ones((64,), mx.bfloat16)
    mx.eval(x, w)
    with launches.structure_of("cuda"):
        y = mx.fast.rms_norm(x, w, 1e-6)
        c = launches.graph([y])
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert c.kinds == {"kernel": 1}
    assert launches.graph([mx.fast.rms_norm(x, w, 1e-6)]).nodes > 1  # the CPU's own chain


@pytest.fixture(scope="module")
def tiny_pair():
    with launches.structure_of("cuda"):
        yield synthetic.build("tiny", bits=4, options=Options(submit_every=0))


def test_decode_step_launches_six_kernels_a_layer(tiny_pair):
    target, _ = tiny_pair
    with launches.structure_of("cuda"):
        step = launches.count_step(target)
    # Per layer, gated-delta: fused input product, conv + recurrence, gated norm, out product
    # with residual, MLP gate/up with swiglu, down with residual; attention: input product,
    # two attention launches, out product, the MLP's two. Then the final norm and the head,
    # and the embedding's dequantization.
    layers = len(target.layers)
    assert step.kinds["kernel"] == 6 * layers + 3
    # the attention layer's KV cache: keys and values written once a step, at the length the
    # graph reads from the device (the step runs as one compiled graph by now)
    assert step.kinds["DynamicSliceUpdate"] == 2 and (1, False) in target.graph_lengths


def test_round_parts_add_up_and_the_device_rollback_picks_each_state_once(tiny_pair):
    target, drafter = tiny_pair
    with launches.structure_of("cuda"):
        parts = launches.count_round(target, drafter, block_size=3, accepted=1)
    assert parts["round"].nodes == sum(parts[p].nodes for p in ("drafts", "verify", "rollback"))
    # decided on the device: every gated-delta layer's window and state picked at the kept
    # count in one launch per kind (kernels.pick_kept), the attention caches given a length
    rollback = parts["rollback"].kinds
    assert rollback["kernel"] == 2 and "DynamicSlice" not in rollback
    assert parts["rollback"].launches <= 8
    # the verify's layers launch what a decode step's do, as one batched block
    assert parts["verify"].kinds["kernel"] == 6 * len(target.layers) + 3


def test_round_refuses_a_target_submitted_in_parts_and_impossible_acceptance(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(ValueError, match="0..2 drafts"):
        launches.count_round(target, drafter, block_size=3, accepted=3)
    parts_target, parts_drafter = synthetic.build("tiny", bits=4, options=Options(submit_every=4))
    with pytest.raises(ValueError, match="submit_every=0"):
        launches.count_round(parts_target, parts_drafter)
