"""The MTP gate: its cost model (pure functions), its on-disk memory, and the CLI's use of it."""

from __future__ import annotations

import json

import pytest

from mtpcli import gate
from mtpcli.cli import run
from mtpcli.gate import Calibration, GateStore
from mtpcli.generation import gate_arms
from mtpcli.stats import GenerationStats, MTPStats


def test_tokens_per_round_is_the_expected_accepted_prefix_plus_one():
    assert gate.tokens_per_round(0.0, 2) == 1.0
    assert gate.tokens_per_round(1.0, 2) == 3.0
    assert gate.tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert gate.tokens_per_round(0.5, 3) == pytest.approx(1.875)


def test_decision_follows_the_cost_model():
    cheap = Calibration(step_ms=10.0, round_ms={3: 16.0})
    d = gate.decide(cheap, [3], 0.6, "prior")
    assert d.engaged and d.expected_speedup == pytest.approx(1.96 * 10 / 16)
    assert "MTP engaged" in d.reason and "prior" in d.reason
    dear = Calibration(step_ms=10.0, round_ms={3: 22.0})
    d = gate.decide(dear, [3], 0.6, "last run")
    assert not d.engaged and d.expected_speedup < 1 and "decoding classically" in d.reason
    # Perfect acceptance cannot save a round dearer than block-size classic steps.
    assert not gate.decide(Calibration(10.0, {3: 31.0}), [3], 1.0, "x").engaged


def test_decision_picks_the_block_size_with_the_best_expected_speedup():
    cal = Calibration(step_ms=10.0, round_ms={2: 12.0, 3: 14.0, 4: 30.0})
    # a = 0.8: E = 1.8 / 2.44 / 2.95 tokens -> 1.50x / 1.74x / 0.98x
    d = gate.decide(cal, [2, 3, 4], 0.8, "prior")
    assert d.engaged and d.block == 3 and "other blocks 2: 1.50x, 4: 0.98x" in d.reason
    # a = 0.2: nothing pays; the decision still names its best block
    d = gate.decide(cal, [2, 3, 4], 0.2, "prior")
    assert not d.engaged and d.block == 2


def test_acceptance_estimate_counts_only_the_drafts_that_were_examined():
    stats = MTPStats(3)
    for n in (2, 0, 1):  # a full accept, a first-draft reject, a second-draft reject
        stats.record(2, n)
    # 3 accepted of 5 examined drafts: the second draft of round 2 was never looked at
    assert gate.acceptance_estimate(stats) == pytest.approx(3 / 5)
    assert gate.acceptance_estimate(MTPStats(3)) is None


def test_store_merges_block_sizes_and_survives_a_corrupt_file(tmp_path):
    path = tmp_path / "gate.json"
    s = GateStore(path)
    s.put_calibration("k", Calibration(1.0, {3: 1.5}))
    s.put_calibration("k", Calibration(1.0, {4: 1.8}))
    again = GateStore(path)
    assert again.calibration("k", [3, 4]).round_ms == {3: 1.5, 4: 1.8}
    assert again.calibration("k", [5]) is None and again.calibration("other", [3]) is None
    again.put_acceptance("pair", 0.7)
    assert GateStore(path).acceptance("pair") == (0.7, "last run")
    path.write_text("{not json")
    assert GateStore(path).calibration("k", [3]) is None  # a cache: start afresh


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """The gate's store in tmp_path and a calibration of chosen costs, counting calls."""
    calls = []
    costs = {"round": 14.0}

    def calibrate(runs, blocks, repeats=3):
        calls.append(list(blocks))
        # every block costs the same per round here, except that 4 is dearer: 3 wins
        rounds = {b: costs["round"] * (2 if b == 4 else 1) for b in blocks}
        return Calibration(10.0, rounds, costs.get("seen"))

    monkeypatch.setattr(gate, "store", lambda: GateStore(tmp_path / "gate.json"))
    monkeypatch.setattr(gate, "calibrate", calibrate)
    return calls, costs


def _generate(capsys, *extra) -> dict:
    capsys.readouterr()
    assert run(["generate", "-p", "abc", "-n", "20", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_gate_engages_where_it_pays_and_calibrates_once(fake_machine, capsys):
    calls, costs = fake_machine
    doc = _generate(capsys)
    assert doc["draft_kind"] == "mtp" and doc["mtp_engaged"] is True
    assert doc["stats"]["rounds"] > 0 and "(prior)" in doc["gate_reason"]
    assert doc["block_size"] == 3
    doc = _generate(capsys)  # the acceptance of the first run now informs the second
    assert calls == [[2, 3, 4]] and "last run" in doc["gate_reason"]
    fixed = _generate(capsys, "--draft-block-size", "2")  # asked for: no choosing
    assert fixed["block_size"] == 2 and fixed["mtp_engaged"] is True
    assert calls == [[2, 3, 4]]  # block 2 was already calibrated


def test_cli_gate_decodes_classically_where_mtp_loses(fake_machine, capsys):
    _, costs = fake_machine
    costs["round"] = 40.0  # a round would cost more than 3 classic steps
    doc = _generate(capsys)
    assert doc["draft_kind"] == "mtp" and doc["mtp_engaged"] is False
    assert doc["stats"]["rounds"] == 0 and "decoding classically" in doc["gate_reason"]
    classic = _generate(capsys, "--draft-kind", "none")
    assert doc["tokens"] == classic["tokens"]
    assert classic["mtp_engaged"] is False and classic["gate_reason"] is None
    forced = _generate(capsys, "--draft-kind", "mtp")
    assert forced["mtp_engaged"] is True and forced["stats"]["rounds"] > 0
    assert forced["tokens"] == classic["tokens"]


def test_cli_gate_reason_goes_to_stderr(fake_machine, capsys):
    _, costs = fake_machine
    costs["round"] = 40.0
    capsys.readouterr()
    assert run(["generate", "-p", "abc", "-n", "4"]) == 0
    err = capsys.readouterr().err
    assert "MTP gate:" in err and "calibrating the MTP gate" in err


def test_real_calibration_measures_positive_costs(load):
    loaded = load()
    cal = gate.calibrate(gate_arms(loaded.target, loaded.drafter, tokens=8), [2, 3], repeats=1)
    assert cal.step_ms > 0 and set(cal.round_ms) == {2, 3}
    assert all(v > 0 for v in cal.round_ms.values())


def _counted(loaded, order: list, tokens: int) -> gate.Arms:
    """``gate_arms`` that note each run they start: "c" for classic, the block for MTP."""
    real = gate_arms(loaded.target, loaded.drafter, tokens=tokens)

    def classic(stats):
        order.append("c")
        return real.classic(stats)

    def mtp(block):
        def run(stats):
            order.append(block)
            return real.mtp(block)(stats)

        return run

    return gate.Arms(classic, mtp)


def test_calibration_stops_early_on_a_slow_model(load):
    # With no time budget left after the first measured run, each side is timed once (plus
    # its warm-up): a large model's calibration stays short.
    order = []
    gate.calibrate(_counted(load(), order, 8), [3], repeats=5, budget_s=0.0)
    assert order.count("c") == 2


def test_calibration_alternates_the_sides(load):
    """Classic and MTP runs alternate after the warm-ups, so a machine that slows down or
    speeds up midway moves both sides' costs alike (one side timed in a slow stretch and the
    other in a fast one mispredicts the speedup)."""
    order = []
    gate.calibrate(_counted(load(), order, 4), [2, 3], repeats=3, budget_s=60.0)
    assert order == ["c", 2, 3] * 4  # warm-ups, then three measured rounds


def test_acceptance_seen_while_calibrating_beats_the_prior_and_is_kept(fake_machine, capsys):
    _, costs = fake_machine
    costs["seen"] = 0.9
    doc = _generate(capsys)
    assert "acceptance 0.90 (measured while calibrating)" in doc["gate_reason"]
    doc = _generate(capsys)  # the first run's own acceptance has replaced it
    assert "(last run)" in doc["gate_reason"]


def test_block_chooser_follows_the_acceptance_seen_so_far():
    # a = 0.9: E = 1.9 / 2.71 / 3.44 tokens -> 1.58x / 1.94x / 2.05x: block 4
    # a = 0.1: E = 1.1 / 1.11 / 1.111 -> 0.92x / 0.79x / 0.66x: block 2
    cal = Calibration(step_ms=10.0, round_ms={2: 12.0, 3: 14.0, 4: 16.8})
    choose = gate.BlockChooser(cal, (2, 3, 4), prior=0.9)
    stats = MTPStats(4)
    assert choose(stats) == 4  # nothing seen yet: the prior
    for _ in range(30):
        stats.record(3, 0)  # every first draft rejected: 30 examined, none accepted
    assert choose(stats) == 2  # (0.9 * 8) / (8 + 30) = 0.19
    for _ in range(60):
        stats.record(1, 1)  # then every draft accepted
    assert choose(stats) == 3  # (7.2 + 60) / (8 + 90) = 0.686 -> 1.40 / 1.54 / 1.48x


def test_stats_of_rounds_of_several_sizes():
    stats = MTPStats(4)
    stats.record(3, 3)
    stats.record(1, 0)
    stats.record(2, 1)
    assert stats.rounds_by_block == {4: 1, 2: 1, 3: 1}
    assert stats.acceptance_by_position == [2 / 3, 1 / 2, 1.0]
    assert stats.examined == 3 + 1 + 2 and gate.acceptance_estimate(stats) == pytest.approx(4 / 6)


def test_an_adapting_block_keeps_mtp_exact(load):
    from mtpcli.engine.classic import generate_classic
    from mtpcli.engine.mtp import generate_mtp

    loaded = load(bits=4)
    sizes = [4, 2, 3, 2, 4, 4, 3]

    def cycle(stats: MTPStats) -> int:
        return sizes[stats.rounds % len(sizes)]

    for prompt in ([72, 101, 108], [(i * 37) % 250 for i in range(40)]):
        stats = GenerationStats()
        mtp = list(generate_mtp(loaded.target, loaded.drafter, prompt, block_size=4,
                                max_tokens=40, stats=stats, choose_block=cycle))  # fmt: skip
        assert mtp == list(generate_classic(loaded.target, prompt, max_tokens=40))
        assert set(stats.mtp.rounds_by_block) == {2, 3, 4}


def test_cli_reports_the_blocks_the_run_chose(fake_machine, capsys):
    doc = _generate(capsys)
    assert doc["mtp_engaged"] is True
    chosen = doc["stats"]["rounds_by_block"]
    assert sum(chosen.values()) == doc["stats"]["rounds"] and set(chosen) <= {"2", "3", "4"}
    fixed = _generate(capsys, "--draft-block-size", "2")
    assert fixed["stats"]["rounds_by_block"] == {"2": fixed["stats"]["rounds"]}
