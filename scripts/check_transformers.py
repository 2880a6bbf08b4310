"""Our raw test checkpoints, read by Hugging Face transformers (an implementation nobody here
wrote): every tensor taken by the full model class, logits and greedy tokens equal to ours.

Needs torch (the lent GPU machine has it; runs on its CPU, float32 on both sides):

    python scripts/check_transformers.py --out DIR      # DIR/transformers_check.json

Per case (dense and MoE): the keys transformers' ``*ForConditionalGeneration`` reports missing,
unexpected or mismatched; the largest logit difference over a 12-token prompt; and 24 greedy
tokens from each side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpcli.config import load_config  # noqa: E402
from mtpcli.engine.classic import generate_classic  # noqa: E402
from mtpcli.fixtures import build_target, tiny_text_config, write_target  # noqa: E402
from mtpcli.models.qwen3_5 import load_target  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
NEW_TOKENS = 24


def _theirs(path: Path, moe: bool):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model.eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].numpy()  # [T, V]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    loading = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}
    return logits, out[0, len(PROMPT) :].tolist(), loading, type(model).__name__


def _ours(path: Path):
    target = load_target(path, load_config(path))
    cache = target.make_cache()
    logits = target.lm_head(target.prefill(mx.array([PROMPT]), cache))[0]  # [T, V]
    tokens = list(generate_classic(target, PROMPT, max_tokens=NEW_TOKENS, eos_ids=()))
    return logits.astype(mx.float32), tokens


def check(moe: bool, root: Path) -> dict:
    import numpy as np

    text = tiny_text_config(moe=moe)
    path = write_target(root / ("moe" if moe else "dense"), text, layout="raw",
                        model=build_target(text, seed=11, dtype=mx.float32),
                        dtype=mx.float32)  # fmt: skip
    theirs, their_tokens, loading, cls = _theirs(path, moe)
    ours, our_tokens = _ours(path)
    diff = float(np.abs(np.array(ours) - theirs).max())
    return {
        "case": "moe" if moe else "dense", "class": cls, "loading": loading,
        "rope_parameters": json.loads((path / "config.json").read_text())["text_config"][
            "rope_parameters"],
        "max_abs_logit_diff": diff, "logit_scale": float(np.abs(theirs).max()),
        "tokens_ours": our_tokens, "tokens_transformers": their_tokens,
        "tokens_equal": our_tokens == their_tokens,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)  # float32 on both sides, no TF32 products
    import torch
    import transformers

    torch.set_num_threads(4)
    results = {"transformers": transformers.__version__, "torch": torch.__version__,
               "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "cases": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for moe in (False, True):
            r = check(moe, Path(tmp))
            results["cases"].append(r)
            print(f"{r['case']}: {r['class']} loading {r['loading']}; max |logit diff| "
                  f"{r['max_abs_logit_diff']:.2e} of {r['logit_scale']:.2f}; greedy tokens equal "
                  f"{r['tokens_equal']}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transformers_check.json").write_text(json.dumps(results, indent=1))
    ok = all(
        r["tokens_equal"] and r["max_abs_logit_diff"] < 1e-4 and not any(r["loading"].values())
        for r in results["cases"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
