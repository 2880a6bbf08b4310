"""Train the built-in example: a small qwen3_5 target and its qwen3_5_mtp head, from scratch.

    python scripts/train_tiny.py --out mtpcli/example_model --seed 0

Text: the Python standard library's own source (every machine with Python has it), split by
file into training and held-out sets. Tokenizer: a byte-level BPE trained on the training files.
Target: 4 layers (3 gated-delta + 1 full attention), hidden 128, about 1M parameters, trained as
a language model for a fixed number of steps (about 25 minutes on 2 CPU cores: MLX's CPU matmul
runs at about 6 GFLOP/s there, which is what bounds the size).
MTP head: trained in the same steps on the target's detached features, to give the target's
next-token distribution one position ahead (hidden at t, embedding of token t+1 -> the target's
distribution at t+1, i.e. its guess for token t+2): agreement with the target, not with the
text, is what acceptance measures. Written in the on-disk layouts users have: an
mlx-community-style quantized target (VLM-style nesting) and a standalone bf16 drafter with
``block_size``, with tokenizer and chat template; plus held-out prompts for ``mtp bench``.
Deterministic for a seed on one machine and MLX build.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mtpcli.config import ModelConfig, TextConfig
from mtpcli.drafters.qwen3_5_mtp import Qwen35MTP
from mtpcli.fixtures import CHAT_TEMPLATE, SPECIAL_TOKENS, write_drafter, write_target
from mtpcli.models.qwen3_5 import build_model

TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 128, "num_hidden_layers": 4,
    "intermediate_size": 384, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": 1024, "max_position_embeddings": 4096,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "tie_word_embeddings": True, "attention_bias": False, "attn_output_gate": True,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                        "mrope_interleaved": True},
}  # fmt: skip
HELD_OUT_EVERY = 10  # every 10th file (in sorted order) is held out


def corpus(max_bytes: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) from the standard library's top-level modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train, held, size = [], [], 0
    for i, f in enumerate(files):
        text = f.read_text(encoding="utf-8", errors="replace")
        if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            held.append(text)
        elif size < max_bytes:
            train.append(text)
            size += len(text)
    return train, held


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


def chat_wrap(text: str, rng: random.Random) -> str:
    """Half the files as a ChatML exchange: the user gives a file's first lines, the assistant
    continues it (so a chat-templated prompt makes sense to the model)."""
    if rng.random() < 0.5:
        return text
    lines = text.splitlines(keepends=True)
    cut = rng.randint(1, min(8, max(1, len(lines) - 1)))
    head, rest = "".join(lines[:cut]), "".join(lines[cut:])
    return f"<|im_start|>user\n{head}<|im_end|>\n<|im_start|>assistant\n{rest}<|im_end|>\n"


def encode(tok, texts: list[str]) -> mx.array:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eot]
    return mx.array(ids, dtype=mx.int32)


def losses(target, head, batch: mx.array):
    """(LM loss, head loss): batch [B, L+1] -> next-token CE; the head's CE against the
    target's (detached) distribution one position ahead."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    text = target.language_model
    hidden = text.model(inputs)  # [B, L, H], final-normed
    embed = text.model.embed_tokens
    logits = embed.as_linear(hidden)  # [B, L, V]
    lm = nn.losses.cross_entropy(logits, labels, reduction="mean")
    # Head input at t: the target's hidden at t and the embedding of token t+1.
    h, e = mx.stop_gradient(hidden[:, :-1]), mx.stop_gradient(embed(inputs[:, 1:]))
    x = head.fc(mx.concatenate([head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(h)], -1))
    for layer in head.layers:
        x = layer(x, mask="causal")
    draft = head.norm(x) @ mx.stop_gradient(embed.weight).T  # [B, L-1, V]: the borrowed head
    teacher = mx.stop_gradient(mx.softmax(logits[:, 1:].astype(mx.float32), axis=-1))
    logp = nn.log_softmax(draft.astype(mx.float32), axis=-1)
    mtp = -(teacher * logp).sum(-1).mean()
    return lm, mtp


class Pair(nn.Module):
    """The target and the head as one module, for one optimiser over both."""

    def __init__(self, target: nn.Module, head: nn.Module):
        super().__init__()
        self.target, self.head = target, head


def _modules(text: dict) -> tuple[nn.Module, nn.Module]:
    cfg = ModelConfig("qwen3_5", TextConfig.from_dict(text, "qwen3_5"), None, (), None, True)
    return build_model(cfg), Qwen35MTP(ModelConfig("qwen3_5_mtp", cfg.text, None, (), 3, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--minutes", type=float, default=None, help="stop early after this long")
    ap.add_argument("--raw", type=Path, default=None, help="also save the float weights here")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", type=int, default=4, help="target quantization (0: bf16)")
    ap.add_argument("--from-raw", type=Path, default=None,
                    help="skip training: write OUT from a run's --raw weights")  # fmt: skip
    args = ap.parse_args()
    mx.random.seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    train_texts, held_texts = corpus(int(args.corpus_mb * 1e6))
    if args.from_raw:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.from_raw / "tokenizer.json"))
        text = dict(TEXT, eos_token_id=tok.token_to_id("<|im_end|>"))
        target, head = _modules(text)
        target.load_weights(str(args.from_raw / "target.safetensors"))
        head.load_weights(str(args.from_raw / "head.safetensors"))
        run = json.loads((args.out / "training.json").read_text())  # the run that trained them
        save(args, target, head, text, tok, held_texts, run["log"], run["steps"],
             run.get("training_command", run["command"]))  # fmt: skip
        return
    tok = train_tokenizer(train_texts, TEXT["vocab_size"])
    data = encode(tok, [chat_wrap(t, rng) for t in train_texts])
    eos = tok.token_to_id("<|im_end|>")
    print(f"{len(train_texts)} files, {data.size} tokens, tokenizer in {time.time() - t0:.1f}s")

    text = dict(TEXT, eos_token_id=eos)
    target, head = _modules(text)
    n_params = sum(v.size for _, v in tree_flatten(target.parameters()))
    print(f"target {n_params / 1e6:.2f}M parameters")

    model = Pair(target, head)
    total_steps = args.steps
    warmup = 50
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warmup),
         optim.cosine_decay(args.lr, total_steps, args.lr * 0.05)], [warmup])  # fmt: skip
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m, batch):
        lm, mtp = losses(m.target, m.head, batch)
        return lm + mtp, (lm, mtp)

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(batch):
        (loss, (lm, mtp)), grads = grad_fn(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return lm, mtp

    L, B = args.length, args.batch
    deadline = t0 + args.minutes * 60 if args.minutes else math.inf
    log = []
    s = 0
    while s < total_steps and time.time() < deadline:
        starts = [rng.randrange(0, data.size - L - 1) for _ in range(B)]
        batch = mx.stack([data[i : i + L + 1] for i in starts])
        lm, mtp = step(batch)
        mx.eval(model.parameters(), opt.state, lm, mtp)
        s += 1
        if s % 25 == 0 or s == 1:
            log.append({"step": s, "lm": lm.item(), "mtp": mtp.item(), "s": time.time() - t0})
            print(json.dumps(log[-1]), flush=True)
    print(f"trained {s} steps in {time.time() - t0:.0f}s")
    if args.raw:
        args.raw.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(
            str(args.raw / "target.safetensors"), dict(tree_flatten(target.parameters()))
        )
        mx.save_safetensors(
            str(args.raw / "head.safetensors"), dict(tree_flatten(head.parameters()))
        )
        tok.save(str(args.raw / "tokenizer.json"))
    save(args, target, head, text, tok, held_texts, log, s)


def save(args, target, head, text, tok, held_texts, log, steps, trained_by=None) -> None:
    out = args.out
    mixers = [ly.linear_attn for ly in target.language_model.model.layers if ly.is_linear]
    a_logs = [m.A_log for m in mixers]
    for m in (target, head):
        m.set_dtype(mx.bfloat16, lambda d: d == mx.float32)
    for m, a in zip(mixers, a_logs, strict=True):  # float32, as in the real checkpoints
        m.A_log = a
    write_target(out / "target", text, bits=args.bits or None, group_size=64, model=target,
                 tokenizer=tok)  # fmt: skip
    write_drafter(out / "drafter", text, module=head, block_size=3)
    prompts = []
    for t in held_texts:
        ids = tok.encode(t).ids
        if len(ids) >= 96:
            prompts.append(tok.decode(ids[:64]))
    (out / "heldout_prompts.txt").write_text("\n".join(json.dumps(p) for p in prompts[:16]) + "\n")
    command = "python scripts/train_tiny.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
    )
    (out / "training.json").write_text(json.dumps({
        "command": command, "training_command": trained_by or command,
        "seed": args.seed, "steps": steps, "log": log, "mlx": mx.__version__,
        "seconds": log[-1]["s"] if log else None,
        "text_config": text, "chat_template": CHAT_TEMPLATE,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
