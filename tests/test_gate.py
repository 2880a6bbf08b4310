"""The MTP gate: its cost model (pure functions), its on-disk memory, and the CLI's use of it."""

from __future__ import annotations

import json

import pytest

from mtpcli import gate
from mtpcli.cli import run
from mtpcli.gate import Calibration, Costs, GateStore
from mtpcli.generation import gate_arms
from mtpcli.stats import GenerationStats, MTPStats


def test_tokens_per_round_is_the_expected_accepted_prefix_plus_one():
    assert gate.tokens_per_round(0.0, 2) == 1.0
    assert gate.tokens_per_round(1.0, 2) == 3.0
    assert gate.tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert gate.tokens_per_round(0.5, 3) == pytest.approx(1.875)


def test_decision_follows_the_cost_model():
    cheap = Calibration.constant(10.0, {3: 16.0})
    d = gate.decide(cheap, [3], 0.6, "prior")
    assert d.engaged and d.expected_speedup == pytest.approx(1.96 * 10 / 16)
    assert "MTP engaged" in d.reason and "prior" in d.reason
    dear = Calibration.constant(10.0, {3: 22.0})
    d = gate.decide(dear, [3], 0.6, "last run")
    assert not d.engaged and d.expected_speedup < 1 and "decoding classically" in d.reason
    # Perfect acceptance cannot save a round dearer than block-size classic steps.
    assert not gate.decide(Calibration.constant(10.0, {3: 31.0}), [3], 1.0, "x").engaged


def test_decision_picks_the_block_size_with_the_best_expected_speedup():
    cal = Calibration.constant(10.0, {2: 12.0, 3: 14.0, 4: 30.0})
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
    s.put_calibration("k", Calibration.constant(1.0, {3: 1.5}))
    s.put_calibration("k", Calibration.constant(1.0, {4: 1.8}))
    again = GateStore(path)
    assert again.calibration("k", [3, 4]).at(0).round_ms == {3: 1.5, 4: 1.8}
    assert again.calibration("k", [5]) is None and again.calibration("other", [3]) is None
    s.put_calibration("k", Calibration({4096: Costs(2.0, {3: 3.5})}))  # a longer context
    both = GateStore(path).calibration("k", [3])
    assert both.contexts == [16, 4096] and both.at(4096).round_ms == {3: 3.5}
    assert GateStore(path).calibration("k", [3, 4]).contexts == [16]  # where all blocks are
    again.put_acceptance("pair", 0.7)
    assert GateStore(path).acceptance("pair") == (0.7, "last run")
    path.write_text("{not json")
    assert GateStore(path).calibration("k", [3]) is None  # a cache: start afresh


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """The gate's store in tmp_path and a calibration of chosen costs, counting calls."""
    calls = []
    costs = {"round": 14.0}

    def calibrate(runs, blocks, contexts=(gate.SHORT,), repeats=3):
        calls.append(list(blocks))
        # every block costs the same per round here, except that 4 is dearer: 3 wins
        rounds = {b: costs["round"] * (2 if b == 4 else 1) for b in blocks}
        return Calibration(dict.fromkeys(contexts, gate.Costs(10.0, rounds)), costs.get("seen"))

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
    cal = gate.calibrate(gate_arms(loaded.target, loaded.drafter, tokens=8), [2, 3],
                         contexts=(16, 512), repeats=1, long_repeats=1)  # fmt: skip
    assert cal.contexts == [16, 512]
    for context in (16, 512):
        costs = cal.costs[context]
        assert costs.step_ms > 0 and set(costs.round_ms) == {2, 3}
        assert all(v > 0 for v in costs.round_ms.values())


def _counted(loaded, order: list, tokens: int) -> gate.Arms:
    """``gate_arms`` that note each run they start: "c" for classic, the block for MTP."""
    real = gate_arms(loaded.target, loaded.drafter, tokens=tokens)

    def classic(context):
        def run(stats):
            order.append("c")
            return real.classic(context)(stats)

        return run

    def mtp(block, context):
        def run(stats):
            order.append(block)
            return real.mtp(block, context)(stats)

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
    # a = 0.19: E = 1.19 / 1.23 / 1.24 -> 0.99x / 0.88x / 0.74x: no block pays, a classic step
    cal = Calibration.constant(10.0, {2: 12.0, 3: 14.0, 4: 16.8})
    choose = gate.BlockChooser(cal, (2, 3, 4), prior=0.9)
    stats = MTPStats(4)
    assert choose(stats, 0) == 4  # nothing seen yet: the prior
    for _ in range(30):
        stats.record(3, 0)  # every first draft rejected: 30 examined, none accepted
    assert choose(stats, 0) == 1  # (0.9 * 8) / (8 + 30) = 0.19
    for _ in range(60):
        stats.record(1, 1)  # then every draft accepted
    assert choose(stats, 0) == 3  # (7.2 + 60) / (8 + 90) = 0.686 -> 1.40 / 1.54 / 1.48x


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

    def cycle(stats: MTPStats, context: int) -> int:
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


def test_costs_between_and_past_the_timed_contexts():
    cal = Calibration({16: Costs(10.0, {3: 14.0}), 4096: Costs(12.0, {3: 24.0})})
    assert cal.at(0) == cal.at(16) == cal.costs[16]
    mid = cal.at(2056)  # halfway: linear
    assert mid.step_ms == pytest.approx(11.0) and mid.round_ms[3] == pytest.approx(19.0)
    far = cal.at(16 + 2 * 4080)  # past the longest: along the last two points
    assert far.step_ms == pytest.approx(14.0) and far.round_ms[3] == pytest.approx(34.0)
    # a longer context timed faster (noise) is not extrapolated downwards
    odd = Calibration({16: Costs(10.0, {3: 14.0}), 4096: Costs(9.0, {3: 13.0})})
    assert odd.at(50_000) == Costs(9.0, {3: 13.0})
    three = Calibration({16: Costs(10.0, {3: 14.0}), 4096: Costs(12.0, {3: 24.0}),
                         16384: Costs(20.0, {3: 60.0})})  # fmt: skip
    assert three.at(10240).step_ms == pytest.approx(16.0)  # between the second and third


def test_calibration_contexts_fit_the_model():
    assert gate.calibration_contexts(262144) == (16, 4096, 16384, 65536)
    assert gate.calibration_contexts(32768) == (16, 4096, 16384)
    assert gate.calibration_contexts(8192) == (16, 4096)
    # the example: room for a prompt of 4096 - 32 generated - the largest block (16)
    assert gate.calibration_contexts(4096) == (16, (4096 - 32 - 16) // 2)
    assert gate.calibration_contexts(100) == (16,)
    # a generation times the lengths it comes within a quarter of
    assert gate.calibration_contexts(262144, end=300) == (16,)
    assert gate.calibration_contexts(262144, end=1024) == (16, 4096)
    assert gate.calibration_contexts(262144, end=5000) == (16, 4096, 16384)
    assert gate.calibration_contexts(262144, end=20000) == (16, 4096, 16384, 65536)


# At acceptance 0.8 a block-3 round emits 2.44 tokens: 1.74x classic at 16 tokens of context,
# 1.22x at 4096, and along the line past it 1.05x near 7,060 and 1.0x near 8,300 tokens.
CONTEXT_COSTS = Calibration({16: Costs(10.0, {3: 14.0}), 4096: Costs(12.0, {3: 24.0})})


def test_gate_decides_at_the_prompts_context():
    short = gate.decide(CONTEXT_COSTS, [3], 0.8, "x", context=100)
    long = gate.decide(CONTEXT_COSTS, [3], 0.8, "x", context=9000)
    assert short.engaged and not long.engaged
    assert "at 9000 tokens of context" in long.reason


def test_block_chooser_switches_mtp_off_where_rounds_stop_paying():
    choose = gate.BlockChooser(CONTEXT_COSTS, (3,), prior=0.8, weight=1e9)
    stats = MTPStats(3)
    assert choose(stats, 1000) == 3
    assert choose(stats, 7500) == 3  # 1.03x: running, kept on above 1.0x
    assert choose(stats, 9000) == 1  # below 1.0x: a classic step
    stats.switch(9000, False)
    assert choose(stats, 7500) == 1  # 1.03x: off, it needs the margin to come back on
    assert choose(stats, 6000) == 3  # 1.09x
    assert stats.switches == [(9000, False)]
    late = gate.BlockChooser(CONTEXT_COSTS, (3,), prior=0.8, weight=1e9, starts_on=False)
    assert late(MTPStats(3), 7500) == 1  # not yet switched on: the margin applies


def test_mtp_switched_off_and_on_mid_generation_stays_exact(load, monkeypatch):
    from mtpcli.engine.classic import generate_classic
    from mtpcli.engine.mtp import Unseen, generate_mtp

    loaded = load(bits=4)
    monkeypatch.setattr(Unseen, "BATCH", 8)  # the drafter catches up several times while off

    def schedule(stats: MTPStats, context: int) -> int:
        return 1 if 10 <= context < 40 else 3

    prompt = [72, 101, 108]
    stats = GenerationStats()
    got = list(generate_mtp(loaded.target, loaded.drafter, prompt, block_size=3, max_tokens=60,
                            stats=stats, choose_block=schedule))  # fmt: skip
    assert got == list(generate_classic(loaded.target, prompt, max_tokens=60))
    (off, was_on), (on, now_on) = stats.mtp.switches
    assert (was_on, now_on) == (False, True) and 10 <= off <= 12 and on == 40
    assert stats.mtp.classic_steps == on - off and stats.mtp.rounds > 0


def _drafts_after_a_classic_stretch(loaded, monkeypatch, batch: int) -> list[list[int]]:
    from mtpcli.engine.mtp import Unseen, draft, generate_mtp

    monkeypatch.setattr(Unseen, "BATCH", batch)
    seen = []

    def propose(*args):
        drafts, q = draft(*args)
        seen.append(drafts.tolist())
        return drafts, q

    def schedule(stats: MTPStats, context: int) -> int:
        return 1 if 8 <= context < 50 else 3

    list(generate_mtp(loaded.target, loaded.drafter, [5, 9, 14, 20], block_size=3, max_tokens=70,
                      propose=propose, choose_block=schedule))  # fmt: skip
    return seen


def test_the_drafter_catches_up_while_rounds_are_off(load, monkeypatch):
    """After a stretch of classic steps the drafter drafts from the whole context: the same
    drafts whether it caught up in batches or at once, in forwards of any length; with the
    catch-up dropping its tokens unseen, they differ."""
    from mtpcli.engine.mtp import Unseen

    loaded = load(bits=4, drafter="random")  # its drafts depend on what it has attended to
    batched = _drafts_after_a_classic_stretch(loaded, monkeypatch, 8)
    at_once = _drafts_after_a_classic_stretch(loaded, monkeypatch, 10**6)
    assert batched == at_once and len(batched) > 5
    monkeypatch.setattr(Unseen, "CHUNK", 3)  # the prompt's and each batch's forward in parts
    assert _drafts_after_a_classic_stretch(loaded, monkeypatch, 8) == batched
    monkeypatch.setattr(Unseen, "CHUNK", 2048)

    real = Unseen.catch_up

    def forget(self, drafter, cache, batch=None):  # the prompt's catch-up as it is
        if batch is not None:
            return real(self, drafter, cache, batch)
        if len(self.tokens) > self.BATCH:
            self.tokens, self.hidden = self.tokens[-1:], self.hidden[-1:]
        return None

    monkeypatch.setattr(Unseen, "catch_up", forget)
    assert _drafts_after_a_classic_stretch(loaded, monkeypatch, 8) != batched


# A machine where a round's cost grows more slowly than a step's: at acceptance 0.6 (1.96
# tokens a round) 0.98x at 16 tokens of context, 1.31x at 4096, 1.05x near 644.
RISING = Calibration({16: Costs(10.0, {3: 20.0}), 4096: Costs(20.0, {3: 30.0})})


def test_first_context_where_rounds_pay():
    at = gate.first_paying(RISING, [3], 0.6, 16, 3000)
    assert 640 <= at <= 650
    assert gate.expected_speedup(RISING, 3, 0.6, at) >= gate.MARGIN
    assert gate.expected_speedup(RISING, 3, 0.6, at - 1) < gate.MARGIN
    assert gate.first_paying(RISING, [3], 0.6, 16, 600) is None  # ends before it pays


def test_cli_starts_mtp_where_the_context_makes_it_pay(tmp_path, monkeypatch, capsys):
    """Below the margin at the prompt but above it further on: the MTP engine runs, classic
    steps first (tokens still classic's), rounds from about the context where they pay."""

    def calibrate(runs, blocks, contexts=(16,), repeats=3):  # 0.98x at 16, 1.36x at 60
        return Calibration({16: Costs(10.0, dict.fromkeys(blocks, 20.0)),
                            60: Costs(14.0, dict.fromkeys(blocks, 20.2))}, 0.6)  # fmt: skip

    monkeypatch.setattr(gate, "store", lambda: GateStore(tmp_path / "gate.json"))
    monkeypatch.setattr(gate, "calibrate", calibrate)
    doc = _generate(capsys, "--draft-block-size", "3")
    prompt = doc["stats"]["prompt_tokens"]
    assert doc["mtp_engaged"] is True and prompt < doc["mtp_from_context"] < prompt + 20
    assert "classic steps until then" in doc["gate_reason"]
    first, *rest = doc["stats"]["switches"]
    assert first == {"context": prompt, "mtp": False} and doc["stats"]["classic_steps"] > 0
    assert rest and rest[0]["mtp"] is True and doc["stats"]["rounds"] > 0
    assert rest[0]["context"] >= doc["mtp_from_context"]
    classic = _generate(capsys, "--draft-kind", "none")
    assert doc["tokens"] == classic["tokens"]
