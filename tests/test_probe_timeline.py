"""scripts/probe_timeline.py's arithmetic: a window's GPU busy time from a kernel trace."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "probe_timeline.py"
_spec = importlib.util.spec_from_file_location("probe_timeline", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_busy_time_is_the_union_of_the_kernels_inside_the_window():
    kernels = [(0, 10), (5, 15), (20, 30), (28, 29), (40, 60)]
    assert probe.busy_us(kernels, 0, 100) == 15 + 10 + 20  # overlaps counted once
    assert probe.busy_us(kernels, 8, 45) == 7 + 10 + 5  # clipped at both ends
    assert probe.busy_us(kernels, 31, 39) == 0
    assert probe.busy_us([], 0, 10) == 0


def _trace() -> list[dict]:
    """Four classic tokens 10 ms apart, each with two 2 ms kernels. Four MTP rounds 20 ms apart,
    each: a 1 ms draft with nothing running, a 6 ms verify build (its mark starts the round)
    with a 15 ms kernel from its start, a 4 ms accept, a 0.5 ms rollback."""
    ev = []
    for i in range(4):
        ev.append({"cat": "user_annotation", "name": "token", "ts": i * 10_000, "dur": 1})
        ev += [{"cat": "kernel", "name": "k", "ts": i * 10_000 + 1000 + j * 3000, "dur": 2000}
               for j in range(2)]  # fmt: skip
    for i in range(4):
        t = 50_000 + i * 20_000
        marks = (("verify", 0, 6000), ("accept", 6000, 4000), ("rollback", 16_000, 500),
                 ("draft", 18_000, 1000))  # fmt: skip
        ev += [{"cat": "user_annotation", "name": name, "ts": t + at, "dur": dur}
               for name, at, dur in marks]  # fmt: skip
        ev.append({"cat": "kernel", "name": "k", "ts": t, "dur": 15_000})
    ev.append({"cat": "cpu_op", "name": "other", "ts": 0, "dur": 99_999})  # not a kernel
    return ev


def test_windows_span_mark_to_mark_and_leave_out_the_first():
    w = probe.windows(_trace())
    # 4 marks make 3 windows; the first (a prefill, in a real run) is left out
    assert [x["wall_us"] for x in w["token"]] == [10_000, 10_000]
    assert all(x["busy_us"] == 4000 and x["kernels"] == 2 for x in w["token"])
    assert [x["busy_us"] for x in w["round"]] == [15_000, 15_000]
    s = probe.summary(_trace())
    assert s["token"]["busy_share"]["median"] == 0.4 and s["round"]["n"] == 2


def test_a_rounds_phases_split_its_host_time_and_the_gpus():
    s = probe.summary(_trace())["round_phases"]
    host = {p: s[p]["host_ms"]["median"] for p in probe.PHASES}
    busy = {p: s[p]["busy_ms"]["median"] for p in probe.PHASES}
    assert host == {"draft": 1.0, "verify": 6.0, "accept": 4.0, "rollback": 0.5}
    assert busy == {"draft": 0.0, "verify": 6.0, "accept": 4.0, "rollback": 0.0}


def test_a_saved_trace_is_summarised_without_a_gpu(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    out = subprocess.run([sys.executable, str(_PATH), "--summary", str(path)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(out.stdout)["round"]["busy_ms"]["median"] == 15.0


def test_the_loops_are_marked_as_the_summary_reads_them(tmp_path, monkeypatch):
    """``run`` on the CPU with a stand-in tracer (PyTorch is not installed here): every classic
    token and every MTP phase is marked, and the marks make the windows and phases."""
    import types
    from argparse import Namespace
    from contextlib import contextmanager

    marks: list[str] = []
    spans: list[list[int]] = []  # per mark: its start and end, in ticks of the host's order
    tick = iter(range(10**9))

    @contextmanager
    def record_function(name):
        marks.append(name)
        spans.append([next(tick), 0])
        span = spans[-1]
        yield
        span[1] = next(tick)

    class Profile:
        def __init__(self, activities):
            marks.clear()
            spans.clear()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):  # a tick is 1 us
            ev = [{"cat": "user_annotation", "name": m, "ts": a, "dur": b - a}
                  for m, (a, b) in zip(marks, spans, strict=True)]  # fmt: skip
            Path(path).write_text(json.dumps({"traceEvents": ev}))

    tp = types.SimpleNamespace(record_function=record_function, profile=Profile,
                               ProfilerActivity=types.SimpleNamespace(CPU=0, CUDA=1))  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(profiler=tp))
    monkeypatch.setitem(sys.modules, "torch.profiler", tp)
    for every in ("0", "1"):
        monkeypatch.setenv("MTP_SUBMIT_EVERY", every)
        args = Namespace(shape="tiny", bits=4, tokens=12, block_size=3, simulate_acceptance=0.7,
                         out=tmp_path, arm=None, reps=1, host_profile=every == "1",
                         wall_only=False, prompt_tokens=8)  # fmt: skip
        s = probe.summary(probe.run(args)[0])
        rounds = marks.count("verify")
        assert marks.count("token") == 13 and rounds == marks.count("accept") > 2  # and the end
        assert marks.count("rollback") == rounds and s["round"]["n"] == rounds - 2
        assert marks.count("draft") == rounds  # a draft a round
        assert set(s["round_phases"]) == set(probe.PHASES)
    assert "generate_mtp" in (tmp_path / "host_profile.txt").read_text()


def test_arms_run_alternating_in_one_process_and_are_summarised_apart(tmp_path, monkeypatch):
    """``--arm``: each arm's settings hold for its own runs only (the target reads them again),
    runs alternate with the order reversed every other time, and each arm's rounds are
    summarised apart, none that crosses from one run to the next."""
    import types
    from argparse import Namespace
    from contextlib import contextmanager

    from mtpcli.engine import mtp as engine

    marks: list[tuple[str, int, int]] = []
    tick = iter(range(10**9))
    seen = []  # per arm run: the submission setting it ran with

    @contextmanager
    def record_function(name):
        start = next(tick)
        yield
        marks.append((name, start, next(tick)))

    class Profile:
        def __init__(self, activities):
            marks.clear()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            ev = [{"cat": "user_annotation", "name": m, "ts": a, "dur": b - a}
                  for m, a, b in marks]  # fmt: skip
            Path(path).write_text(json.dumps({"traceEvents": ev}))

    tp = types.SimpleNamespace(record_function=record_function, profile=Profile,
                               ProfilerActivity=types.SimpleNamespace(CPU=0, CUDA=1))  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(profiler=tp))
    monkeypatch.setitem(sys.modules, "torch.profiler", tp)
    real = engine.generate_mtp

    def generate_mtp(target, *a, **kw):
        seen.append(target.submit_every)
        return real(target, *a, **kw)

    monkeypatch.setattr(engine, "generate_mtp", generate_mtp)
    monkeypatch.delenv("MTP_SUBMIT_EVERY", raising=False)  # 0 on the CPU
    args = Namespace(shape="tiny", bits=4, tokens=12, block_size=3, simulate_acceptance=0.7,
                     out=tmp_path, arm=["base", "both:MTP_SUBMIT_EVERY=1,MTP_UNREAD=x"],
                     reps=3, host_profile=False, wall_only=False, prompt_tokens=8)  # fmt: skip
    s = probe.summary(probe.run(args)[0])
    # warm-up (base, both), then base both, both base, base both
    on, off = 1, 0
    assert seen == [off, on, off, on, on, off, off, on]
    runs = ["base", "both", "both", "base", "base", "both"]
    assert [m for m, _, _ in marks if m.startswith("arm ")] == [f"arm {r}" for r in runs]
    arms = s["arms"]
    assert set(arms) == {"base", "both"} and all(a["runs"] == 3 for a in arms.values())
    verifies = sum(m == "verify" for m, _, _ in marks)
    # rounds run verify to verify: of those, the first is left out (as in a plain run) and the
    # five that cross from one run into the next; every other counts once, for its own arm
    assert sum(a["round"]["n"] for a in arms.values()) == verifies - 1 - 1 - 5
    assert not {"MTP_SUBMIT_EVERY", "MTP_UNREAD"} & set(os.environ)


def test_a_round_that_crosses_arms_is_left_out():
    ev = _trace()  # rounds (verify marks) at 50, 70, 90 and 110 ms
    ev += [{"cat": "user_annotation", "name": "arm a", "ts": 50_000, "dur": 40_001},
           {"cat": "user_annotation", "name": "arm b", "ts": 90_000, "dur": 40_000}]  # fmt: skip
    arms = probe.summary(ev)["arms"]
    assert arms["a"]["round"]["n"] == 1 and arms["b"]["round"]["n"] == 1
    assert arms["a"]["round_phases"]["verify"]["host_ms"]["median"] == 6.0
    ev[-2]["dur"] = 35_000  # a's range now ends inside its round from 70 to 90 ms
    assert "a" not in probe.summary(ev)["arms"]


def test_wall_summary_pairs_each_arm_with_the_first_in_its_repetition():
    runs = [{"arm": "classic", "rep": r, "tps": 100.0, "round_ms": 10.0} for r in range(3)]
    runs += [
        {"arm": "a", "rep": r, "tps": t, "round_ms": 1e3 / t} for r, t in enumerate((100, 200, 50))
    ]
    runs += [
        {"arm": "b", "rep": r, "tps": t, "round_ms": 1e3 / t} for r, t in enumerate((110, 180, 60))
    ]
    w = probe.wall_summary(runs)
    assert w["a"]["tps"]["median"] == 100 and w["b"]["tps"]["median"] == 110
    # paired by repetition: 1.1, 0.9, 1.2 -> median 1.1 (unpaired medians would say 1.1 too,
    # so also the spread, which only pairing gives)
    ratio = w["b"]["tps_over_a"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (1.1, 0.9, 1.2)
    assert "tps_over_a" not in w["a"] and w["classic"]["tps_over_a"]["median"] == 1.0


def test_wall_only_runs_without_a_tracer(tmp_path, monkeypatch):
    """``--wall-only`` needs no PyTorch: a classic run then every arm's, each repetition."""
    from argparse import Namespace

    monkeypatch.setitem(sys.modules, "torch", None)  # importing it would fail
    args = Namespace(shape="tiny", bits=4, tokens=10, block_size=3, simulate_acceptance=0.7,
                     out=tmp_path, arm=["x", "y:MTP_SUBMIT_EVERY=2"], reps=2,
                     host_profile=False, wall_only=True, prompt_tokens=8)  # fmt: skip
    events, runs = probe.run(args)
    assert events == []
    assert [(r["arm"], r["rep"]) for r in runs] == [
        ("classic", 0), ("x", 0), ("y", 0), ("classic", 1), ("y", 1), ("x", 1)]  # fmt: skip
    assert all(r["tps"] > 0 and r["round_ms"] > 0 for r in runs)
    w = probe.wall_summary(runs)
    assert set(w) == {"classic", "x", "y"} and w["y"]["tps_over_x"]["n"] == 2
