"""Rounds decided on the device and built ahead (``engine.mtp.submit_round``): once the verify
is a graph reading its caches' length on the device, a temperature-0 round's accepted count,
rollback and the next round's input stay on the device, and round r + 1 is built before round
r is read. Run on the CPU with the GPU's paths (``test_graph_forward.gpu_paths``): the tokens
stay classic's, the drafts stay those of rounds the host reads first, and breaking the device
rollback or the drafter's kept length changes what comes out."""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx
import pytest

from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import draft, generate_mtp
from mtpcli.loading import load_pair
from mtpcli.models import qwen3_5 as tm
from mtpcli.models.kv_cache import RowsKVCache
from mtpcli.stats import GenerationStats, MTPStats

PROMPTS = [[72, 101, 108, 108, 111], [(i * 37) % 250 for i in range(40)]]


def _pair(ckpts, bits=4, random_drafter=False):
    """A pair of its own (graphs traced under the fixture must not reach other tests); a
    random drafter is right now and then, so its drafts show what it attended to."""
    drafter = ckpts.drafter(bits=bits, predictable=None, seed=5) if random_drafter else \
        ckpts.drafter(bits=bits)  # fmt: skip
    return load_pair(str(ckpts.target(bits=bits)), str(drafter))


def _run(loaded, prompt, *, graph=True, max_tokens=40, base=draft, **kw):
    target = loaded.target
    if not graph:  # the same weights, every round read before its rollback
        target = target.with_options(replace(target.options, graph=False))
    stats = GenerationStats()
    drafted = []

    def propose(*args):
        drafts, q = base(*args)
        drafted.append(drafts)
        return drafts, q

    tokens = list(generate_mtp(target, loaded.drafter, prompt, max_tokens=max_tokens,
                               stats=stats, propose=propose, **kw))  # fmt: skip
    return tokens, stats.mtp, [d.tolist() for d in drafted]


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
@pytest.mark.parametrize("block", [2, 3, 5])
def test_rounds_built_ahead_emit_classic_tokens_and_the_same_drafts(ckpts, gpu_paths, bits,
                                                                    block):  # fmt: skip
    loaded = _pair(ckpts, bits, random_drafter=True)
    for prompt in PROMPTS:
        want = list(generate_classic(loaded.target, prompt, max_tokens=40))
        read_first, rs_read, drafts_read = _run(loaded, prompt, graph=False, block_size=block)
        ahead, rs, drafts = _run(loaded, prompt, block_size=block)
        assert ahead == read_first == want
        assert rs_read.ahead == 0 and rs.ahead >= rs.rounds - 3 > 0
        # the drafter kept what each round emitted: the same drafts, the same acceptance
        assert drafts[: len(drafts_read)] == drafts_read
        assert rs.accept_histogram == rs_read.accept_histogram


def test_block_sizes_and_classic_stretches_change_under_rounds_built_ahead(ckpts, gpu_paths):
    loaded = _pair(ckpts)

    for prompt in PROMPTS:
        start = len(prompt)

        def schedule(stats: MTPStats, context: int, start=start) -> int:
            if 15 <= context - start < 21:
                return 1
            return (2, 4, 3)[context % 3]

        want = list(generate_classic(loaded.target, prompt, max_tokens=60))
        got, rs, _ = _run(loaded, prompt, max_tokens=60, block_size=4, choose_block=schedule)
        assert got == want
        assert rs.ahead > 0 and rs.classic_steps > 0 and len(rs.rounds_by_block) > 1


def test_eos_and_max_tokens_end_a_generation_with_a_round_in_flight(ckpts, gpu_paths):
    loaded = _pair(ckpts)
    prompt = PROMPTS[1]
    want = list(generate_classic(loaded.target, prompt, max_tokens=40))
    stop = want[25]
    got, rs, _ = _run(loaded, prompt, block_size=3, eos_ids=[stop])
    assert got == want[: want.index(stop)] and rs.ahead > 0
    for n in (1, 2, 7, 31):
        assert _run(loaded, prompt, block_size=3, max_tokens=n)[0] == want[:n]
    read_first, rs, _ = _run(loaded, prompt, block_size=3, build_ahead=False)
    assert read_first == want and rs.ahead == 0  # the bench's comparison arm


def test_host_offsets_settle_to_the_lengths_the_device_kept(ckpts, gpu_paths, monkeypatch):
    """Each time the host reads a round, an attention cache's offset (target's and drafter's)
    bounds its device length from above, and equals it once nothing is in flight."""
    loaded = _pair(ckpts)
    checked = []
    settle = RowsKVCache.settle

    def checking(self, dropped, idle):
        if self.device_length is not None:
            length = int(self.device_length.item())
            assert self.offset - dropped == length if idle else self.offset - dropped >= length
            checked.append(idle)
        settle(self, dropped, idle)

    monkeypatch.setattr(RowsKVCache, "settle", checking)
    for prompt in PROMPTS:
        tokens, rs, _ = _run(loaded, prompt, block_size=3, max_tokens=30)
        assert rs.ahead > 0 and len(tokens) == 30
    assert True in checked and False in checked


@pytest.mark.parametrize("broken", ["kept_count", "state", "conv", "drafter_keep"])
def test_a_broken_device_rollback_changes_the_tokens_or_the_drafts(
    ckpts, gpu_paths, monkeypatch, broken
):
    loaded = _pair(ckpts, random_drafter=True)
    prompt = PROMPTS[1]
    want = list(generate_classic(loaded.target, prompt, max_tokens=40))
    _, _, drafts_read = _run(loaded, prompt, graph=False, block_size=3)
    rollback, pick = tm.rollback_on_device, tm.pick_kept
    base = draft
    if broken == "kept_count":  # one position more kept than accepted

        def one_more(cache, traces, n_keep, block, mode):
            rollback(cache, traces, mx.minimum(n_keep + 1, block), block, mode)

        monkeypatch.setattr(tm, "rollback_on_device", one_more)
    elif broken in ("state", "conv"):

        def wrong(conv_inputs, states, finals, n_keep, block, mode):
            windows, kept = pick(conv_inputs, states, finals, n_keep, block, mode)
            if broken == "state":
                return windows, finals  # the block's last state whatever was accepted
            return [c[:, -w.shape[1] :] for c, w in zip(conv_inputs, windows, strict=True)], kept

        monkeypatch.setattr(tm, "pick_kept", wrong)
    else:  # the drafter keeps the whole block, rejected positions included

        def base(drafter, target, catch, cache, k, s, position=0):
            if catch.last is not None:
                catch = replace(catch, last=mx.array([catch.tokens.shape[0] - 1], mx.int32))
            return draft(drafter, target, catch, cache, k, s, position)

    fresh = _pair(ckpts, random_drafter=True)
    got, rs, drafts = _run(fresh, prompt, block_size=3, base=base)
    assert rs.ahead > 0
    if broken == "drafter_keep":  # the tokens stay exact; the drafts do not
        assert got == want and drafts[: len(drafts_read)] != drafts_read
    else:
        assert got != want


def test_the_cli_says_how_many_rounds_were_built_ahead(gpu_paths, capsys):
    from mtpcli.cli import run

    argv = ["generate", "-p", "def f(x):", "-n", "24", "--draft-kind", "mtp", "--temp", "0"]
    assert run(argv) == 0
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert re.search(r"MTP: \d+ rounds .* tokens/verify, [1-9]\d* built ahead \(decided on", err)
