"""scripts/ab_traced.py: each arm's own target, built, traced and run with its flag value;
arms alternating; node counts of unsubmitted graphs; on / off paired by repetition."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import pytest

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(monkeypatch):
    monkeypatch.syspath_prepend(str(_SCRIPTS))  # it imports probe_host_bound beside it
    spec = importlib.util.spec_from_file_location("ab_traced", _SCRIPTS / "ab_traced.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLAG = sys.modules[__name__]
SWITCH = None  # the flag under test: this module's attribute


def _switch():
    return FLAG.SWITCH


def test_each_arm_runs_its_own_target_with_its_value(monkeypatch):
    ab = _load(monkeypatch)
    seen = []  # (what, target, flag value)
    built = []
    real_build = ab.synthetic.build

    def build(shape, bits):
        built.append(_switch())
        return real_build(shape, bits=bits)

    def costs(target, drafter, prompt, n):
        seen.append(("costs", id(target), _switch()))
        return {"build_ms": {"decode_step": 2.0 if _switch() else 4.0},
                "submit_ms": {"decode_step": 1.0}}  # fmt: skip

    def decode_run(target, prompt, tokens, sync):
        seen.append(("decode", id(target), _switch()))
        return {"build": 1.0, "submit": 1.0, "wait": 1.0, "token": 3.0 if _switch() else 2.0}

    monkeypatch.setattr(ab.synthetic, "build", build)
    monkeypatch.setattr(ab.phb, "build_costs", costs)
    monkeypatch.setattr(ab.phb, "decode_run", decode_run)
    monkeypatch.setattr(FLAG, "SWITCH", "before")
    res = ab.run_ab(__name__, "SWITCH", shape="tiny", reps=3)
    assert built == [False, True] and SWITCH == "before"  # restored after
    targets = {value: {t for _, t, v in seen if v == value} for value in (False, True)}
    assert len(targets[False]) == len(targets[True]) == 1 and targets[False] != targets[True]
    order = [row["arm"] for row in res["runs"]]
    assert order == ["off", "on", "on", "off", "off", "on"]
    paired = res["on_over_off"]
    assert paired["build_ms.decode_step"] == {"median": 0.5, "min": 0.5, "max": 0.5,
                                              "below_1": 3, "n": 3}  # fmt: skip
    assert paired["decode.token"]["median"] == 1.5 and paired["decode.token"]["below_1"] == 0
    for arm in ("off", "on"):  # counted before the runs, nothing submitted inside the block
        counts = res["nodes"][arm]
        assert counts["decode_step"]["total"] > 0
        assert counts["verify_block_3"]["total"] > counts["decode_step"]["total"]


def test_nodes_counts_an_unevaluated_graph_by_primitive(monkeypatch):
    ab = _load(monkeypatch)
    a = mx.array([1.0, 2.0])
    mx.eval(a)
    count = ab.nodes([(a * 2 + 1).reshape(2, 1)])
    assert count["Multiply"] == 1 and count["Add"] == 1 and count["Reshape"] == 1
    b = (a * 2).reshape(2, 1)
    mx.eval(b)
    assert sum(ab.nodes([b]).values()) == 0  # evaluated: no graph left


def test_a_bad_flag_is_a_named_exit(monkeypatch):
    ab = _load(monkeypatch)
    for flag, says in (
        ("nocolon", "module.path:ATTRIBUTE"),
        ("no_such_module_x:A", "cannot import"),
        ("mtpcli.kernels.quantized_matmul:NO_SUCH", "has no attribute"),
    ):
        monkeypatch.setattr(sys, "argv", ["ab_traced.py", "--flag", flag])
        with pytest.raises(SystemExit, match=says):
            ab.main()
