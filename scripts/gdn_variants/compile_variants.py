import importlib.util
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")
import test_cuda_compile as tc

for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("mtpcli.kernels.gd_variant", path)
    v = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(v)
    for keep in (False, True):
        dtype = tc.BF16
        types = dict.fromkeys(v._CONV_INPUTS, dtype) | {
            "state_in": tc.F32,
            "A_log": tc.F32,
            "conv_w": tc.F32,
        }
        outputs = {"y": dtype, "state_out": tc.F32} | ({"states": tc.F32} if keep else {})
        outputs |= {"inputs": dtype, "window_out": dtype}
        constants = {
            "InT": dtype,
            "Dk": 128,
            "Dv": 128,
            "Hk": 16,
            "Hv": 48,
            "R": v._ROWS,
            "WARPS": v._WARPS,
            "HPT": 1,
            "AT": tc.F32,
            "DT": dtype,
            "WT": tc.F32,
            "CK": 4,
        }
        s = v._spec(False, keep, True, conv=True)
        d = Path(tempfile.mkdtemp())
        rep = tc._compile(d, tc._wrap(s["source"], s["header"], types, outputs, constants))
        print(
            Path(path).name,
            keep,
            re.findall(r"Used \d+ registers|\d+ bytes smem|\d+ bytes spill stores", rep),
        )
