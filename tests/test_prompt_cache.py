"""The prompt cache: a prompt that starts as an earlier one did resumes from a snapshot of the
caches and gives the tokens of a cold start (dense and MoE, bf16 and 4-bit, classic and MTP,
greedy and seeded sampling); snapshots only where a prompt's processing stops between chunks;
least recently used out, bounded in bytes.

The expected tokens are those of the same request with no prompt cache."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli.engine.prompt_cache import PromptCache, PromptStart, Snapshot
from mtpcli.engine.sampling import SamplingParams
from mtpcli.generation import generate
from mtpcli.models import qwen3_5 as tm

CHUNK = 16
SYSTEM = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # a shared prefix, a message of 40
A = SYSTEM + [(i * 13) % 250 + 3 for i in range(9)]  # 49 tokens: cuts 16, 32, 48
B = SYSTEM + [(i * 29) % 250 + 3 for i in range(6)]  # 46 tokens


@pytest.fixture(autouse=True)
def _chunk(monkeypatch):
    monkeypatch.setattr(tm, "PREFILL_CHUNK", CHUNK)


def _run(pair, ids, cache, *, mtp=False, boundaries=(), n=16, **kw):
    r = generate(pair, ids, max_tokens=n, force_mtp=mtp, block_size=3 if mtp else None,
                 prompt_cache=cache, boundaries=boundaries, **kw)  # fmt: skip
    return r.tokens, r.stats.prompt_cached


@pytest.mark.parametrize("mtp", [False, True], ids=["classic", "mtp"])
@pytest.mark.parametrize(("moe", "bits"), [(False, 4), (False, None), (True, 4)],
                         ids=["dense-4bit", "dense-bf16", "moe-4bit"])  # fmt: skip
def test_resumed_prompts_give_the_tokens_of_a_cold_start(load, mtp, moe, bits):
    pair = load(moe=moe, bits=bits)
    cache = PromptCache(1 << 30)
    cold = {name: _run(pair, ids, None, mtp=mtp, boundaries=[40])[0]
            for name, ids in (("a", A), ("b", B))}  # fmt: skip
    nxt = A + cold["a"] + [7, 8, 9]  # the next turn: the answer and a new message
    cold["next"] = _run(pair, nxt, None, mtp=mtp, boundaries=[40])[0]

    assert _run(pair, A, cache, mtp=mtp, boundaries=[40]) == (cold["a"], 0)
    # the shared prefix: the snapshot where the shared message ends
    assert _run(pair, B, cache, mtp=mtp, boundaries=[40]) == (cold["b"], 40)
    # the same prompt again: its last position but one
    assert _run(pair, A, cache, mtp=mtp, boundaries=[40]) == (cold["a"], len(A) - 1)
    # the next turn: the last multiple of the chunk in the earlier prompt
    assert _run(pair, nxt, cache, mtp=mtp, boundaries=[40]) == (cold["next"], 48)
    # nowhere the chunks before differ: without a cut at 40 no snapshot here serves it
    assert _run(pair, nxt, cache, mtp=mtp) == (cold["next"], 0)


def test_seeded_sampling_is_reproduced_from_a_snapshot(load):
    pair = load(bits=4)
    hot = SamplingParams(temp=1.0, top_p=0.9)
    cold = _run(pair, A, None, sampling=hot, seed=3, n=24)[0]
    cache = PromptCache(1 << 30)
    _run(pair, A, cache, sampling=hot, seed=5, n=4)
    assert _run(pair, A, cache, sampling=hot, seed=3, n=24) == (cold, len(A) - 1)


def test_a_snapshot_that_loses_the_recurrent_state_is_caught(load, monkeypatch):
    """Mutation: snapshots whose gated-delta states are zeros (as if the state were cut back
    like a KV cache) give other tokens, so the tests above can fail."""
    pair = load(bits=4)
    cold = _run(pair, B, None)[0]
    keep = tm.snapshot

    def without_state(cache):
        return [s if isinstance(s, tm.RowsKVCache) else (s[0], mx.zeros_like(s[1]))
                for s in keep(cache)]  # fmt: skip

    monkeypatch.setattr(tm, "snapshot", without_state)
    cache = PromptCache(1 << 30)
    _run(pair, A, cache, boundaries=[40])
    warm, cached = _run(pair, B, cache, boundaries=[40])
    assert cached == 40 and warm != cold


def test_a_snapshot_of_the_wrong_length_is_caught(load, monkeypatch):
    """Mutation: a snapshot labelled a chunk short of what it holds gives other tokens."""
    pair = load(bits=4)
    cold = _run(pair, B, None)[0]
    cut = PromptStart.cut

    def late(self, target, cache, p):
        if p == 48:  # A's cache after 48 tokens, filed as its first 32
            self.cuts.add(p)
            snap = Snapshot(self.ids[:32], target.snapshot(cache))
            self.cache.put(snap)
            return
        cut(self, target, cache, p)

    monkeypatch.setattr(PromptStart, "cut", late)
    cache = PromptCache(1 << 30)
    _run(pair, A, cache)
    warm, cached = _run(pair, B, cache)
    assert cached == 32 and warm != cold


def test_mtp_resumes_only_from_snapshots_with_the_drafters_part(load):
    pair = load(bits=4)
    cache = PromptCache(1 << 30)
    _run(pair, A, cache)  # classic: target parts only
    assert all(s.drafter is None for s in cache.entries.values())
    cold = _run(pair, A, None, mtp=True)[0]
    assert _run(pair, A, cache, mtp=True) == (cold, 0)
    # the MTP run replaced them with snapshots that hold the drafter's part
    assert all(s.drafter is not None for s in cache.entries.values())
    assert _run(pair, A, cache, mtp=True) == (cold, len(A) - 1)


def _snap(tokens, nbytes: int) -> Snapshot:
    return Snapshot(tuple(tokens), [(mx.zeros((nbytes // 4,), mx.float32), None)])


def test_a_snapshot_serves_prompts_that_have_a_cut_where_it_ends():
    s32, s45 = _snap(A[:32], 4), _snap(A[:45], 4)
    assert s32.serves(A) and s32.serves(A[:33]) and s32.serves(B)
    assert not s32.serves(A[:32])  # a prompt needs a token of its own to process
    assert not s32.serves([1] + A[1:])  # another first token
    assert s45.serves(A[:46]) and s45.serves(A[:45] + [1])  # the prompt's last but one
    assert not s45.serves(A)  # 45 is no cut of a 49-token prompt
    assert s45.serves(A, boundaries=[45])  # unless one of its messages ends there
    assert not s45.serves(A, boundaries=[20, 45])  # made without a cut at 20
    s45_20 = Snapshot(tuple(A[:45]), [], below=(20,))
    assert s45_20.serves(A, boundaries=[20, 45]) and not s45_20.serves(A, boundaries=[45])


def test_cuts_to_keep_are_cuts_of_every_prompt_that_shares_them():
    cache = PromptCache(1 << 20)
    assert cache.cuts_to_keep(A) == {48}
    assert cache.cuts_to_keep(A, boundaries=[40, 5, 60]) == {5, 40, 48}  # 60: past the end
    assert cache.cuts_to_keep(A, boundaries=[40], start=40) == {48}
    cache.put(_snap(A[:40], 4))
    assert cache.cuts_to_keep(A, boundaries=[40]) == {48}
    assert cache.cuts_to_keep(A, boundaries=[40], drafter=True) == {40, 48}


def test_least_recently_used_goes_first_and_the_bytes_stay_bounded():
    cache = PromptCache(1000)
    for n in (16, 32, 48):
        cache.put(_snap(A[:n], 400))
    assert [len(k) for k in cache.entries] == [32, 48] and cache.bytes == 800
    assert cache.find(A[:33]).length == 32  # now the most recently used
    cache.put(_snap(B[:16] + [1] * 16, 400))
    assert [len(k) for k in cache.entries] == [32, 32] and cache.stats.evicted == 2
    cache.put(_snap(A[:16], 2000))  # larger than the whole cache: not kept
    assert cache.bytes == 800 and len(cache.entries) == 2
    assert cache.find(A).length == 32 and cache.stats.hits == 2 and cache.stats.lookups == 2


def test_an_mtp_run_that_ends_at_its_first_token_leaves_whole_snapshots(load):
    """The drafter's parts are taken after the first token is out (it does not wait for the
    drafter's pass over the prompt); a run that ends there still leaves them."""
    pair = load(bits=4)
    cache = PromptCache(1 << 30)
    assert _run(pair, A, cache, mtp=True, n=1)[1] == 0
    assert cache.entries and all(s.drafter is not None for s in cache.entries.values())
    cold = _run(pair, A, None, mtp=True)[0]
    assert _run(pair, A, cache, mtp=True) == (cold, len(A) - 1)


def test_prefill_stops_at_the_chunks_the_messages_and_before_the_last_token(load, monkeypatch):
    target = load(bits=4).target
    seen = []
    forward = type(target).forward

    def spy(self, tokens, cache, **kw):
        seen.append(tokens.shape[1])
        return forward(self, tokens, cache, **kw)

    monkeypatch.setattr(type(target), "forward", spy)
    cuts = []
    target.prefill(mx.array([A]), target.make_cache(), every_position=False,
                   on_cut=cuts.append, cuts=(20, 40))  # fmt: skip
    assert seen == [16, 4, 12, 8, 8, 1] and cuts == [16, 20, 32, 40, 48]


def test_message_ends_survive_a_template_that_wants_a_user_turn():
    """Qwen's templates refuse a conversation without a user message: each message's end is
    found with an empty user turn after it."""
    from mtpcli.errors import PromptError
    from mtpcli.tokenizer import message_ends

    class Chat:  # one token a character; refuses what has no user message
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            if not any(m["role"] == "user" for m in messages):
                raise ValueError("No user query found in messages.")
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    chat = [
        {"role": "system", "content": "abc"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"},
    ]
    ids = Chat().encode(Chat().apply_chat_template(chat, False, True))
    assert message_ends(Chat(), chat, ids) == [
        len("<system>abc<user>"),
        len("<system>abc<user>hi<"),
        len("<system>abc<user>hi<assistant>yo<user>"),
    ]

    class Refuses(Chat):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            raise ValueError("broken template")

    try:
        message_ends(Refuses(), chat, ids)
    except PromptError:
        raise AssertionError("a template that fails gives no boundary, not an error") from None
