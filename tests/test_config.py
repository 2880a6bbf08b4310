from __future__ import annotations

import pytest

from mtpcli.config import TextConfig
from mtpcli.errors import BadConfigError, ConfigOutOfBoundsError
from mtpcli.fixtures import tiny_text_config


def test_only_known_fields_are_kept_and_defaults_filled():
    d = tiny_text_config()
    d["some_future_field"] = 1
    c = TextConfig.from_dict(d, "qwen3_5")
    assert not hasattr(c, "some_future_field")
    assert c.hidden_size == 64 and c.rope_parameters["rope_theta"] == 1e7  # the published one
    assert c.to_mlx_lm()["rope_parameters"]["type"] == "default"


def test_legacy_top_level_rope_fields_are_folded_in():
    d = tiny_text_config()
    d.pop("rope_parameters")
    d["rope_theta"] = 5e5
    assert TextConfig.from_dict(d, "qwen3_5").rope_parameters["rope_theta"] == 5e5


@pytest.mark.parametrize(
    "key,value",
    [("hidden_size", 0), ("hidden_size", True), ("num_attention_heads", 10**6),
     ("head_dim", "16"), ("linear_conv_kernel_dim", 1000), ("num_experts", -1),
     ("tie_word_embeddings", "yes"), ("rms_norm_eps", float("nan")),
     ("linear_num_value_heads", 5), ("max_position_embeddings", 10**12)],
)  # fmt: skip
def test_out_of_bounds(key, value):
    d = tiny_text_config()
    d[key] = value
    with pytest.raises(ConfigOutOfBoundsError):
        TextConfig.from_dict(d, "qwen3_5")


def test_missing_required_field():
    d = tiny_text_config()
    d.pop("vocab_size")
    with pytest.raises(BadConfigError, match="vocab_size"):
        TextConfig.from_dict(d, "qwen3_5")
