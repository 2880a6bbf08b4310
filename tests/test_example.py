"""The built-in example is a trained pair in the real on-disk layouts: its text is predictable,
its drafts are accepted often but not always (natural partial acceptance), and MTP still
reproduces classic decoding exactly."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.example import EXAMPLE_DIR, ensure_example, example_prompts
from mtpcli.loading import load_pair
from mtpcli.stats import GenerationStats


@pytest.fixture(scope="module")
def example():
    target, drafter = ensure_example()
    return load_pair(str(target), str(drafter))


def test_layouts_are_the_real_ones():
    target, drafter = ensure_example()
    tcfg = json.loads((target / "config.json").read_text())
    dcfg = json.loads((drafter / "config.json").read_text())
    assert tcfg["model_type"] == "qwen3_5" and "text_config" in tcfg  # mlx-community VLM-style
    assert dcfg["model_type"] == "qwen3_5_mtp" and dcfg["block_size"] >= 2
    assert "chat_template" in json.loads((target / "tokenizer_config.json").read_text())
    size = sum(f.stat().st_size for f in EXAMPLE_DIR.rglob("*") if f.is_file())
    assert size < 8e6  # a few MB in the package


def test_the_target_has_learned_its_text(example):
    """Held-out text (standard-library files it never saw) is far from uniform to it (an
    untrained model scores about the uniform cross-entropy, log V)."""
    target, tok = example.target, example.tokenizer
    losses = []
    for text in example_prompts()[:4]:
        ids = mx.array([tok.encode(text)])
        hidden = target.forward(ids[:, :-1], target.make_cache()).hidden
        logits = target.lm_head(hidden).astype(mx.float32)
        losses.append(nn.losses.cross_entropy(logits[0], ids[0, 1:], reduction="mean").item())
    uniform = math.log(target.config.text.vocab_size)
    assert sum(losses) / len(losses) < 0.8 * uniform, losses


def test_natural_partial_acceptance_and_exactness(example):
    stats = GenerationStats()
    accepted = drafted = partial = 0
    for text in example_prompts()[:3]:
        prompt = example.tokenizer.encode(text)
        want = list(generate_classic(example.target, prompt, max_tokens=48))
        got = list(generate_mtp(example.target, example.drafter, prompt, block_size=3,
                                max_tokens=48, stats=stats))  # fmt: skip
        assert got == want
        accepted += stats.mtp.accepted
        drafted += stats.mtp.drafted
        partial += stats.mtp.accept_histogram[1]  # rounds that kept the first draft only
    rate = accepted / drafted
    # Trained, the head agrees with the target often but not always.
    assert 0.3 < rate < 1.0 and partial > 0, (rate, partial)
