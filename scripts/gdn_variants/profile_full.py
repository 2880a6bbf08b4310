"""One launch each of the product's gated-delta kernel (the 27B layer, geometry 8 warps x 2 rows,
bound 3 blocks) at T = 1, T = 3 with states, T = 3 and T = 8 with states, between
cuProfilerStart and Stop, for ``ncu --set full``: where a launch's time goes (issue, stalls,
DRAM). ``--module FILE`` runs another version of the module."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn_geometry as b  # noqa: E402 - a sibling script
import mlx.core as mx  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--module", type=Path, help="another version of mtpcli/kernels/gated_delta.py")
module = ap.parse_args().module
if module is not None:
    if not module.is_file():
        raise SystemExit(f"{module}: no such file")
    b.use_module(module)
b._set(8, 2, 3)
cases = [(1, False), (3, True), (3, False), (8, True)]
inputs = {T: b._inputs(T) for T, _ in cases}
for T, keep in cases:

    def launch(T=T, keep=keep):
        return b.gd.gated_delta_conv_native(*inputs[T], (b.HK, b.DK, b.HV, b.DV), keep_states=keep)

    mx.eval(launch())
    b.profiled(launch, 1)
    print(f"T={T} keep={keep} profiled", flush=True)
