"""Each variant's emulated outputs bitwise HEAD's (T = 1, 3, 10 with states; 3 without)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "tests")
import cuda_emulation  # noqa: E402
import test_kernel_emulation as tke  # noqa: E402

from mtpcli.kernels import gated_delta as head  # noqa: E402

for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("mtpcli.kernels.gd_variant", path)
    v = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(v)
    for T, keep, heads in [
        (1, False, None),
        (3, True, None),
        (3, False, None),
        (10, True, None),
        (3, True, (1, 128, 2, 16)),
        (1, False, (1, 128, 2, 16)),
    ]:
        heads = heads or (tke.HK, tke.DK, tke.HV, tke.DV)
        x = tke._conv_layer_inputs(T, seed=60 + T, heads=heads)
        hdr = getattr(v, "_BULK_HEADER", "")
        hk, dk, hv, dv = heads
        K, nc = x["conv_w"].shape[1], x["qkv"].shape[2]
        outputs = {"y": (1, T, hv, dv), "state_out": (1, hv, dv, dk)}
        outputs |= {"states": (T - 1, 1, hv, dv, dk)} if keep else {}
        outputs |= {"inputs": (1, K - 1 + T, nc), "window_out": (1, K - 1, nc)}
        got = list(
            cuda_emulation.run(
                v._source(False, keep, True, conv=True),
                x,
                outputs,
                {
                    "Dk": dk,
                    "Dv": dv,
                    "Hk": hk,
                    "Hv": hv,
                    **head._layout(hk, hv, dv, T),
                    "CK": K,
                },
                *head._geometry(1, hv, dv, head._layout(hk, hv, dv, T)),
                header=hdr,
            ).values()
        )
        want = tke._emulate_conv(x, keep, heads=heads)
        same = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        print(Path(path).name, T, keep, dk, "bitwise HEAD" if same else "DIFFERS")
        if not same:
            for name, a, b in zip(outputs, got, want, strict=True):
                print("  ", name, np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
