"""Which part of a MoE block gives other bits compiled than op by op (on CUDA).

    python scripts/probe_moe_compile.py [--shape tiny-moe] [--bits 4] [--out DIR]

On the H200, 4-bit MoE exactness failed with compiled layer functions and passed without
them, so GPUs now run routed layers op by op (docs/design.md). This splits mlx-lm's sparse MoE
block into its stages (the router, the experts, the weighted combine, the shared expert with
its gate and the sum) and runs each one-token input through every stage op by op and
``mx.compile``d, on the same inputs; a stage whose outputs differ is where a targeted fix
belongs. Prints one JSON object (and writes it under ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from mtpcli import synthetic


def stages(moe) -> dict:
    """The block's stages as pure functions, in the order mlx-lm's ``__call__`` runs them."""

    def router(x):
        gates = mx.softmax(moe.gate(x), axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-moe.top_k, axis=-1)[..., -moe.top_k :]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if moe.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores

    def combine(y, scores):
        return (y * scores[..., None]).sum(axis=-2)

    def shared(x, y):
        return y + mx.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)

    return {"router": router, "experts": moe.switch_mlp, "combine": combine, "shared": shared,
            "block": moe}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny-moe", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8, 16))
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not synthetic.SHAPES[args.shape].get("num_experts"):
        raise SystemExit(f"{args.shape} has no experts")
    target, _ = synthetic.build(args.shape, bits=None if args.bits == 16 else args.bits)
    layer = target.layers[0]
    fns = stages(layer.mlp)
    compiled = {name: mx.compile(fn) for name, fn in fns.items()}
    differ = dict.fromkeys(fns, 0)
    for i in range(args.inputs):
        tokens = mx.array([[(i * 7919) % target.config.text.vocab_size]])
        x = layer.post_attention_layernorm(target.embed_tokens(tokens))  # [1, 1, H]
        inds, scores = fns["router"](x)
        y = fns["experts"](x, inds)
        z = fns["combine"](y, scores)
        feeds = {"router": (x,), "experts": (x, inds), "combine": (y, scores),
                 "shared": (x, z), "block": (x,)}  # fmt: skip
        for name, fn in fns.items():
            a, b = fn(*feeds[name]), compiled[name](*feeds[name])
            a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
            if not all(mx.array_equal(u, v).item() for u, v in zip(a, b, strict=True)):
                differ[name] += 1
    doc = {"device": str(mx.default_device()), "shape": args.shape, "bits": args.bits,
           "inputs": args.inputs, "differing_inputs_by_stage": differ}  # fmt: skip
    print(json.dumps(doc))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"moe_compile_{args.shape}_{args.bits}bit.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
