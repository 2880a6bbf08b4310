"""A rollback decided on the device: every gated-delta layer's conv window and recurrent state
after the first ``n_keep`` positions of a verify block, where ``n_keep`` is an int32 [1] array
the host has not read (or [B]: a batch of requests' rows, row b keeping its own count).

A verify keeps, per layer, its conv inputs [B, K-1+T, C] and the state after each position but
the last [T-1, B, Hv, Dv, Dk] beside the final state. With MLX's ops the pick is two dynamic
slices and a select per layer (three launches; 144 for the 27B's 48 layers). The kernels here
take every layer at once: one launch copies each layer's kept state, one each layer's window
(on Metal, whose kernels take at most 31 buffers, in groups of layers). Each is a plain copy,
so the native result is the reference's bitwise.
"""

from __future__ import annotations

import mlx.core as mx

from . import available, backend, built, fill, kernel_name, spell, use_native

# Layers a launch takes: Metal binds at most 31 buffers (the count and, per layer, the
# state kernel's two inputs and output, the window kernel's input and output).
GROUP = {"cuda": 64, "metal": 10}
_THREADS = 256


def pick_kept_ops(conv_inputs: list, states: list, finals: list, n_keep: mx.array, block: int):
    """Ops reference. Per layer: conv inputs [B, K-1+T, C], per-step states [T-1, B, Hv, Dv,
    Dk] (float32), final state [B, Hv, Dv, Dk]; ``n_keep`` int32 [1] or [B] (each row's) in
    [1, T], T = ``block``. Returns the windows [B, K-1, C] (inputs n_keep .. n_keep+K-2) and
    the kept states (after position n_keep - 1: the final state where n_keep = T)."""
    windows, kept = [], []
    last = mx.minimum(n_keep - 1, block - 2)  # the per-step states stop one short of the block
    if n_keep.size > 1:
        return _rows_ops(conv_inputs, states, finals, n_keep, last, block)
    for conv_input, steps, final in zip(conv_inputs, states, finals, strict=True):
        B, _, C = conv_input.shape
        windows.append(mx.slice(conv_input, n_keep, (1,), (B, conv_input.shape[1] - block, C)))
        step = mx.slice(steps, last, (0,), (1, *steps.shape[1:])).reshape(final.shape)
        kept.append(mx.where(n_keep == block, final, step))
    return windows, kept


def _rows_ops(conv_inputs: list, states: list, finals: list, n_keep: mx.array, last: mx.array,
              block: int):  # fmt: skip
    """``pick_kept_ops`` with a count per row: n_keep, last [B]."""
    windows, kept = [], []
    B = n_keep.size
    rows = mx.arange(B)
    for conv_input, steps, final in zip(conv_inputs, states, finals, strict=True):
        W = conv_input.shape[1] - block
        offsets = mx.arange(W, dtype=n_keep.dtype).reshape(1, W, 1)
        at = n_keep.reshape(B, 1, 1) + offsets  # [B, W, 1]
        windows.append(mx.take_along_axis(conv_input, at, axis=1))  # [B, W, C]
        step = steps[last, rows]  # [B, Hv, Dv, Dk]
        kept.append(mx.where((n_keep == block).reshape(B, 1, 1, 1), final, step))
    return windows, kept


# One thread per element of a layer's state (x) and one row of threads per layer (y): thread
# i of layer l copies element i of the state kept. The layer's arrays are picked by a switch,
# since a kernel's buffers are named one by one. R counts: 1 for every row, else one a row.
_STATES = """
    const int l = {{LAYER}};
    const size_t i = {{INDEX}};
    if (i < N) {
      const int kept = keep[R == 1 ? 0 : i / (N / R)] - 1;
      DEVICE const float* src = nullptr;
      DEVICE float* dst = nullptr;
      switch (l) {
{{CASES}}
      }
      dst[i] = src[i];
    }
"""
_STATE_CASE = ("        case {l}: src = kept == T - 1 ? f{l} : s{l} + (size_t)kept * N; "
               "dst = o{l}; break;")  # fmt: skip

# Thread i of layer l copies element i of its window [B, W, C], W = K - 1, from row
# n_keep + r of the layer's conv inputs [B, W + T, C].
_WINDOWS = """
    const int l = {{LAYER}};
    const size_t i = {{INDEX}};
    if (i < (size_t)B * W * C) {
      const size_t c = i % C;
      const size_t r = (i / C) % W;
      const size_t b = i / ((size_t)W * C);
      DEVICE const InT* src = nullptr;
      DEVICE InT* dst = nullptr;
      switch (l) {
{{CASES}}
      }
      dst[i] = src[(b * (W + T) + keep[R == 1 ? 0 : b] + r) * C + c];
    }
"""
_WINDOW_CASE = "        case {l}: src = c{l}; dst = w{l}; break;"

_INDICES = {
    False: ("blockIdx.y", "(size_t)blockIdx.x * blockDim.x + threadIdx.x"),
    True: ("threadgroup_position_in_grid.y", "thread_position_in_grid.x"),
}


def source(kind: str, layers: int, metal: bool) -> str:
    """The ``kind`` ("states" or "windows") kernel's body for ``layers`` layers."""
    text, case = (_STATES, _STATE_CASE) if kind == "states" else (_WINDOWS, _WINDOW_CASE)
    layer, index = _INDICES[metal]
    cases = "\n".join(case.format(l=i) for i in range(layers))
    return spell(fill(text, LAYER=layer, INDEX=index, CASES=cases), metal)


def names(kind: str, layers: int) -> tuple[list[str], list[str]]:
    """The kernel's input and output names."""
    if kind == "states":
        ins = ["keep"] + [f"s{i}" for i in range(layers)] + [f"f{i}" for i in range(layers)]
        return ins, [f"o{i}" for i in range(layers)]
    return ["keep"] + [f"c{i}" for i in range(layers)], [f"w{i}" for i in range(layers)]


_kernels: dict = {}


def _kernel(kind: str, layers: int):
    def spec(metal: bool) -> dict:
        text = source(kind, layers, metal)
        ins, outs = names(kind, layers)
        return {"name": kernel_name(f"mtp_pick_{kind}", text), "input_names": ins,
                "output_names": outs, "source": text}  # fmt: skip

    return built(_kernels, (kind, layers), spec)


def _groups(n: int) -> list[range]:
    size = GROUP[backend()] if backend() in GROUP else n
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def pick_kept_native(conv_inputs: list, states: list, finals: list, n_keep: mx.array,
                     block: int):  # fmt: skip
    """The kernels (``pick_kept_ops``' contract); None where there are none."""
    windows, kept = [], []
    for group in _groups(len(finals)):
        L = len(group)
        sk, wk = _kernel("states", L), _kernel("windows", L)
        if sk is None or wk is None:
            return None
        shape = finals[group[0]].shape
        N = finals[group[0]].size
        kept += sk(
            inputs=[n_keep, *(states[i] for i in group), *(finals[i] for i in group)],
            template=[("T", block), ("N", N), ("R", n_keep.size)],
            grid=(-(-N // _THREADS) * _THREADS, L, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[shape] * L,
            output_dtypes=[mx.float32] * L,
        )
        B, rows, C = conv_inputs[group[0]].shape  # rows: the window's and the block's
        W = rows - block
        windows += wk(
            inputs=[n_keep, *(conv_inputs[i] for i in group)],
            template=[
                ("InT", conv_inputs[group[0]].dtype),
                ("T", block),
                ("W", W),
                ("B", B),
                ("C", C),
                ("R", n_keep.size),
            ],  # fmt: skip
            grid=(-(-(B * W * C) // _THREADS) * _THREADS, L, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[(B, W, C)] * L,
            output_dtypes=[conv_inputs[group[0]].dtype] * L,
        )
    return windows, kept


def _self_check(layers: int, block: int, dtype) -> str | None:
    """The kernels against the reference on small arrays of the same layer count and block,
    at every kept count, for every row and per row: a copy, so bitwise."""
    B, W, C, state = 2, 3, 40, (2, 2, 4, 8)
    keys = mx.random.split(mx.random.key(77), 3)
    convs = [mx.random.normal((layers, B, W + block, C), key=keys[0]).astype(dtype)[i]
             for i in range(layers)]  # fmt: skip
    steps = [mx.random.normal((layers, block - 1, *state), key=keys[1])[i] for i in range(layers)]
    finals = [mx.random.normal((layers, *state), key=keys[2])[i] for i in range(layers)]
    counts = [[n] for n in range(1, block + 1)] + [[n, block + 1 - n] for n in range(1, block + 1)]
    for n in counts:
        keep = mx.array(n, mx.int32)
        try:
            got = pick_kept_native(convs, steps, finals, keep, block)
            want = pick_kept_ops(convs, steps, finals, keep, block)
            mx.eval(got, want)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
            return f"{type(e).__name__}: {e}"
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            if a.shape != b.shape or a.dtype != b.dtype or not mx.array_equal(a, b).item():
                return f"differs at n_keep {n}"
    return None


def pick_kept(conv_inputs: list, states: list, finals: list, n_keep: mx.array, block: int,
              mode: str = "auto"):  # fmt: skip
    """The windows and states kept (``pick_kept_ops``' contract) on the best trusted path
    under kernel ``mode``. The check runs here, so call this outside a compiled function."""
    if not finals:
        return [], []
    dtype = conv_inputs[0].dtype
    key = (backend(), len(finals), block, str(dtype))
    if (
        backend() != "cpu"
        and all(s.dtype == mx.float32 for s in states)
        and available(backend())
        and use_native("pick_kept", key, lambda: _self_check(len(finals), block, dtype), mode)
    ):  # fmt: skip
        out = pick_kept_native(conv_inputs, states, finals, n_keep, block)
        if out is not None:
            return out
    return _ops_compiled(conv_inputs, states, finals, n_keep, block)


_ops_compiled = mx.compile(pick_kept_ops)
