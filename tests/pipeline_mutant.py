"""Run by tests/test_pipeline.py under mlx.launch -n 2, the first argument saying how to break
the pipeline, the rest ``mtp``'s: ``drop-layer`` splits so that no rank runs layer 1 (the
tokens must change); ``die`` ends rank 1 at its fifth forward (rank 0 must stop with a named
error)."""

import os
import sys

import mlx.core as mx

from mtpcli.cli import run
from mtpcli.models import pipeline, qwen3_5

how, args = sys.argv[1], sys.argv[2:]
if how == "drop-layer":
    pipeline.split = lambda n_layers, size: [range(2, n_layers), range(0, 1)]
elif how == "die" and mx.distributed.init().rank() == 1:
    forward, calls = qwen3_5.Qwen35Target.forward, []

    def dying(self, *a, **k):
        calls.append(1)
        if len(calls) == 5:
            os._exit(3)
        return forward(self, *a, **k)

    qwen3_5.Qwen35Target.forward = dying
sys.exit(run(args))
