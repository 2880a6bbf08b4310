"""The gated-delta recurrence of Qwen3.5's linear-attention layers, with per-step states.

The verify pass needs the state after every position so that the rollback can restore the
state after any accepted prefix without running the target again. ``gated_delta`` is the one
public entry; today it runs the ops reference on every backend (native CUDA / Metal kernels
plug in here behind a run-time self-check).
"""

from __future__ import annotations

import mlx.core as mx


@mx.compile
def _step(q, k, v, g, beta, state):
    """One recurrent step.

    q, k: [B, Hv, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dv, Dk] (float32).
    Returns y [B, Hv, Dv] (q's dtype) and the new state.
    """
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, Hv, Dv]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # [B, Hv, Dv]
    return y.astype(q.dtype), state


def gated_delta_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    keep_states: bool = False,
) -> tuple[mx.array, mx.array, list[mx.array] | None]:
    """Ops reference: T sequential steps.

    Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk].
    Returns y [B, T, Hv, Dv], the final state, and (with ``keep_states``) the T states after
    each step, each [B, Hv, Dv, Dk]. Position t reads only step t's inputs and state t-1, so a
    T-step call equals T one-step calls bitwise.
    """
    hk, hv = k.shape[2], v.shape[2]
    if hv > hk:
        q = mx.repeat(q, hv // hk, axis=2)
        k = mx.repeat(k, hv // hk, axis=2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        if keep_states:
            states.append(state)
    return mx.stack(ys, axis=1), state, (states if keep_states else None)


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    keep_states: bool = False,
) -> tuple[mx.array, mx.array, list[mx.array] | None]:
    """Run the recurrence on the best available path (see ``gated_delta_ops`` for shapes)."""
    return gated_delta_ops(q, k, v, g, beta, state, keep_states=keep_states)
