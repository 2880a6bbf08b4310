"""``mtp bench``: the report's figures exist, are labelled, and simulated acceptance works."""

from __future__ import annotations

import json
import re

import pytest

from mtpcli import kernels
from mtpcli.bench import markdown
from mtpcli.cli import run


def _bench(capsys, *args) -> dict:
    capsys.readouterr()
    assert run(["bench", "--repeats", "1", "-n", "12", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_json_on_the_example(capsys, tmp_path, monkeypatch):
    """One run of the example (its report's figures, the gate's prediction beside the
    measurement, its held-out prompts): every bench run pays a warm-up and a calibration."""
    import mtpcli.example as example
    from mtpcli import gate
    from mtpcli.bench import _fit_acceptance
    from mtpcli.gate import tokens_per_round

    calls, held_out = [], example.example_prompts

    def recording():
        calls.append(1)
        return held_out()

    monkeypatch.setattr(example, "example_prompts", recording)
    doc = _bench(capsys, "--block-size", "2", "--block-size", "3", "--out", str(tmp_path))
    assert calls and doc["settings"]["prompts"] == 3  # the example's held-out prompts
    assert doc["classic_tps"] > 0 and set(doc["mtp_tps"]) == {"2", "3"}
    assert set(doc["speedup"]) == {"2", "3"} and 0 <= doc["acceptance_rate"]["3"] <= 1
    assert sorted(int(t) for t in doc["verify_cost"]) == list(range(1, 9))
    assert all(arm.get("same_tokens_as_classic", True) for arm in doc["arms"].values())
    # a verify's time splits into building its graph and waiting for it (the compute, here)
    built, verify = (
        doc["arms"]["mtp-3"][f"{k}_ms_per_round"]["median"] for k in ("verify_build", "verify")
    )
    assert 0 < built < verify
    assert doc["machine"]["backend"] == "cpu" and len(doc["machine"]["load_before"]) == 3
    for arm in doc["arms"].values():  # each repeat's figure beside the machine's state then
        assert [r["tps"] for r in arm["repeats"]] == [arm["tps"]["median"]]
        assert arm["repeats"][0]["load_1min"] >= 0
    md = next(tmp_path.glob("bench-*.md")).read_text()
    assert "mtp block 3" in md and "median (min-max)" in md and "of which building" in md
    assert json.loads(next(tmp_path.glob("bench-*.json")).read_text())["settings"]["repeats"] == 1
    assert abs(tokens_per_round(_fit_acceptance(2.2, 2), 2) - 2.2) < 1e-9
    for block in ("2", "3"):
        g = doc["gate"][block]
        assert g["predicted_speedup"] > 0 and g["measured_speedup"] == doc["speedup"][block]
        assert g["gate_engages"] == (g["predicted_speedup"] >= gate.MARGIN)
    assert "predicted" in md


def test_conditions_read_the_gpus_state_where_nvidia_smi_answers(tmp_path, monkeypatch):
    """A repeat's conditions: the host's load, and the GPU's clocks, temperature, power and
    throttle reasons from ``nvidia-smi`` (a stand-in here); none where it fails or is absent."""
    from mtpcli.bench import GPU_QUERY, conditions

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase $1 in *reasons*) echo 0x0000000000000000;; "
                   "*) echo '1980, 2619, 41, 312.50';; esac\n")  # fmt: skip
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    got = conditions()
    assert got["gpu"] == dict(zip(GPU_QUERY, ["1980", "2619", "41", "312.50",
                                              "0x0000000000000000"], strict=True))  # fmt: skip
    smi.write_text("#!/bin/sh\ncase $1 in *reasons*) exit 6;; *) echo '1980, 2619, 41, 312.50';; "
                   "esac\n")  # fmt: skip
    without_reasons = dict(zip(GPU_QUERY[:-1], ["1980", "2619", "41", "312.50"], strict=True))
    assert conditions()["gpu"] == without_reasons  # a driver that lacks the field
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert "gpu" not in conditions() and conditions()["load_1min"] >= 0
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert set(conditions()) == {"load_1min"}


def test_simulated_acceptance_controls_acceptance(ckpts, capsys):
    """A random drafter is never right; swapping in the target's own token makes it so."""
    target, drafter = str(ckpts.target()), str(ckpts.drafter(predictable=None, seed=5))
    base = ["-m", target, "--draft-model", drafter, "--block-size", "3", "--no-verify-table"]
    never = _bench(capsys, *base)
    always = _bench(capsys, *base, "--simulate-acceptance", "1.0")
    assert never["acceptance_rate"]["3"] < 0.2
    assert always["acceptance_rate"]["3"] == 1.0
    assert always["arms"]["mtp-3"]["same_tokens_as_classic"] is True


def test_peers_run_on_the_same_weights(capsys):
    doc = _bench(capsys, "--block-size", "2", "--peers", "--no-verify-table",
                 "--no-gate-check")  # fmt: skip
    assert doc["arms"]["mlx_lm"]["same_tokens_as_classic"] is True
    # mlx-vlm's own MTP decoding of the same checkpoints (installed with the test extra): at
    # temperature 0 its tokens equal our classic tokens over these short generations (over
    # 64-token ones they differ: docs/benchmark_results/cpu_example_bench_9e23fa2.md).
    vlm = doc["arms"]["mlx_vlm-2"]
    assert vlm["tps"]["median"] > 0 and vlm["same_tokens_as_classic"] is True
    assert doc["settings"]["peer_notes"] == []


def test_a_synthetic_pair_written_to_disk_is_the_model_that_synthetic_builds(tmp_path):
    """Peers that load from disk (mlx-vlm) must run the very weights ``--synthetic`` builds."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtpcli import synthetic
    from mtpcli.loading import load_pair

    target, drafter = synthetic.write("tiny", tmp_path, bits=4)
    pair = load_pair(str(target), str(drafter), "mtp")
    built, built_drafter = synthetic.build("tiny", bits=4)
    pairs = ((pair.target.model, built.model), (pair.drafter.module, built_drafter.module))
    for ours, theirs in pairs:
        a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    vocab = synthetic.SHAPES["tiny"]["vocab_size"]
    assert pair.tokenizer.decode([vocab - 4, 65]) == f"<{vocab - 4}>A"  # every id decodes
    assert pair.target.config.eos_token_ids == (vocab - 1,)


def test_a_peer_that_cannot_load_the_pair_becomes_a_note(capsys, monkeypatch):
    from mtpcli import bench

    def refuse(self, target_dir, drafter_dir):
        raise TypeError("missing 1 required positional argument")

    monkeypatch.setattr(bench.MlxVlmPeer, "__init__", refuse)
    doc = _bench(capsys, "--block-size", "2", "--peers", "--no-verify-table",
                 "--no-gate-check")  # fmt: skip
    assert not any(k.startswith("mlx_vlm") for k in doc["arms"]) and "mlx_lm" in doc["arms"]
    assert doc["settings"]["peer_notes"] == [
        "mlx-vlm: could not load this pair (TypeError: missing 1 required positional argument)"
    ]


def test_bad_bench_arguments(capsys):
    for args in (["--block-size", "1"], ["--simulate-acceptance", "2"], ["--synthetic", "nope"]):
        capsys.readouterr()
        assert run(["bench", *args]) != 0
        assert "error:" in capsys.readouterr().err


def test_synthetic_shape_and_prompts_file(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt, a little longer\n")
    doc = _bench(capsys, "--synthetic", "tiny", "--bits", "4", "--prompts", str(prompts),
                 "--block-size", "2", "--no-verify-table", "--no-gate-check")  # fmt: skip
    assert doc["settings"]["prompts"] == 2 and "synthetic tiny 4-bit" in doc["settings"]["model"]
    assert doc["arms"]["mtp-2"]["same_tokens_as_classic"] is True
    # How blocks were submitted is part of what a figure means: the default, recorded.
    every = 0 if kernels.backend() == "cpu" else 8
    assert doc["settings"]["submit_every"] == every
    doc["settings"]["submit_every"] = 0
    assert "each verify block submitted at its wait" in markdown(doc)
    doc["settings"]["submit_every"] = 8
    assert "verify blocks submitted every 8 layers" in markdown(doc)
    capsys.readouterr()
    assert run(["bench", "--prompts", str(tmp_path / "missing.txt")]) != 0


def test_synthetic_moe_shape(capsys):
    from mtpcli import synthetic

    big = synthetic.SHAPES["qwen3.5-35b-a3b"]  # built on the GPU machine only (~35B weights)
    assert big["num_experts"] == 256 and big["num_experts_per_tok"] == 8
    doc = _bench(capsys, "--synthetic", "tiny-moe", "--bits", "4", "--block-size", "3",
                 "--no-gate-check", "--no-verify-table", "-n", "6")  # fmt: skip
    assert "synthetic tiny-moe 4-bit" in doc["settings"]["model"]
    assert doc["arms"]["mtp-3"]["same_tokens_as_classic"] is True
    assert doc["gate"] is None  # --no-gate-check: no calibration


def test_prompt_files_take_json_strings_for_multiline_prompts(tmp_path):
    from mtpcli.bench import read_prompts
    from mtpcli.errors import UsageError

    path = tmp_path / "prompts.txt"
    path.write_text('"def f(x):\\n    return x"\nplain text\n\n"unterminated\n')
    assert read_prompts(path) == ["def f(x):\n    return x", "plain text", '"unterminated']
    path.write_text("\n\n")
    with pytest.raises(UsageError, match="holds no prompt"):
        read_prompts(path)


def test_peers_on_a_synthetic_model_and_no_timed_run_starts_on_dropped_traces(capsys, monkeypatch):
    """The mlx-lm peer runs on MLX's own layer classes between our timed runs; our compiled
    layer functions survive the swap, so no timed run of ours pays for tracing. mlx-vlm, which
    loads from disk, is not run on a synthetic model, and the report says so."""
    from mtpcli import bench
    from mtpcli.models.qwen3_5 import COMPILE_MAX_T, LayerFunctions

    timed, cold = {"on": False}, []
    begin, run_arm = LayerFunctions.begin, bench.run_arm

    def watched_begin(self, T, B=1):
        warm = begin(self, T, B)
        if timed["on"] and not warm and T <= COMPILE_MAX_T:  # longer prompts never compile
            cold.append(T)
        return warm

    def timed_run(arm, generate):
        timed["on"] = True
        try:
            return run_arm(arm, generate)
        finally:
            timed["on"] = False

    monkeypatch.setattr(LayerFunctions, "begin", watched_begin)
    monkeypatch.setattr(bench, "run_arm", timed_run)
    capsys.readouterr()
    args = ["bench", "--synthetic", "tiny", "--block-size", "2", "--peers", "--no-verify-table",
            "--qmm", "ours", "--repeats", "2", "-n", "6", "--no-gate-check", "--json"]  # fmt: skip
    assert run(args) == 0
    assert cold == []
    doc = json.loads(capsys.readouterr().out)
    assert "mlx_lm" in doc["arms"] and not any(k.startswith("mlx_vlm") for k in doc["arms"])
    assert "mlx-vlm: not run" in doc["settings"]["peer_notes"][0]


def test_the_report_to_a_pipe_keeps_its_tables_whole(capsys):
    """Not to a terminal (a file, a pipe, the device tool's log), the report is its Markdown:
    every arm's row has its median and min-max, not Rich's 80-column cut."""
    capsys.readouterr()
    args = ["bench", "--repeats", "1", "-n", "8", "--no-verify-table", "--no-gate-check"]
    assert run(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| classic") or
            line.startswith("| mtp block")]  # fmt: skip
    assert len(rows) == 2 and "…" not in out
    assert all(re.search(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", row) for row in rows)


def test_bench_at_context_lengths(capsys, tmp_path):
    """--context: the arms after prompts of those lengths, MTP whose rounds the gate chooses
    beside them (its tokens classic's too), and the gate's prediction at each length."""
    doc = _bench(capsys, "--context", "64", "--context", "320", "--simulate-acceptance", "0.6",
                 "--no-verify-table", "--out", str(tmp_path))  # fmt: skip
    assert doc["settings"]["contexts"] == [64, 320]
    assert [row["context"] for row in doc["contexts"]] == [64, 320]
    for row in doc["contexts"]:
        assert row["classic_tps"] > 0 and set(row["arms"]) == {"classic", "mtp-3", "mtp-gated"}
        assert all(
            arm["same_tokens_as_classic"] for k, arm in row["arms"].items() if k != "classic"
        )
        g = row["gate"]
        assert g["context"] == row["context"] and g["3"]["predicted_speedup"] > 0
        # ending below a quarter of the next length the example has room for (2024), the gate
        # times its shortest alone
        assert list(g["calibration"]) == ["16"]
    md = next(tmp_path.glob("bench-*.md")).read_text()
    assert "## At 64 tokens of context" in md and "## At 320 tokens of context" in md
    assert "mtp, rounds chosen by the gate" in md


@pytest.mark.parametrize("value", ["0", "4090"])
def test_bench_refuses_a_context_the_model_has_no_room_for(capsys, value):
    capsys.readouterr()
    assert run(["bench", "--context", value, "-n", "12"]) == 2
    assert "--context" in capsys.readouterr().err
