"""The target's tokenizer (mlx-lm's wrapper) and turning a prompt into ids, with named errors."""

from __future__ import annotations

from pathlib import Path

from .errors import PromptError, TokenizerError
from .files import MAX_JSON_BYTES, regular_file

# Files the tokenizer libraries open when present: each must be a bounded regular file.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json",
    "merges.txt", "tokenizer.model",
)  # fmt: skip


def load_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...], vocab_size: int):
    """mlx-lm's tokenizer wrapper (chat template, streaming detokenizer, EOS ids), refused if
    any of its ids lies outside the model's ``vocab_size`` embedding rows."""
    from mlx_lm.tokenizer_utils import load as load_tok

    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer.model").exists():
        raise TokenizerError(f"{model_dir} has no tokenizer (tokenizer.json or tokenizer.model)")
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if path.exists() or path.is_symlink():
            regular_file(path, name, TokenizerError, MAX_JSON_BYTES)
    try:
        tokenizer = load_tok(model_dir, eos_token_ids=list(eos_token_ids) or None)
        top = max(tokenizer.get_vocab().values(), default=-1)
    except Exception as e:  # noqa: BLE001 - tokenizer libraries raise many types
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {e}") from e
    if top >= vocab_size:
        raise TokenizerError(
            f"the tokenizer in {model_dir} has token id {top}, but the model embeds only "
            f"{vocab_size} ids (vocab_size); the tokenizer belongs to another model"
        )
    return tokenizer


def encode_prompt(
    tokenizer, prompt: str, system: str | None = None, ignore_template: bool = False
) -> list[int]:
    """Prompt ids: through the chat template when the tokenizer has one (and it is not
    ignored), else the plain text."""
    for what, text in (("prompt", prompt), ("system prompt", system or "")):
        _check_utf8(what, text)
    if ignore_template or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt)
    return encode_messages(tokenizer, prompt_messages(prompt, system))


def prompt_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation ``encode_prompt`` puts through the chat template."""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A conversation's ids through the chat template, ready for the assistant's turn; without
    a template, the contents joined by blank lines as plain text."""
    for m in messages:
        _check_utf8(f"{m['role']} message", m["content"])
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n\n".join(m["content"] for m in messages))
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template is a user-supplied Jinja program
        raise PromptError(
            f"the chat template failed ({type(e).__name__}: {e}); fix the template or pass "
            "--ignore-chat-template"
        ) from e
    return tokenizer.encode(text, add_special_tokens=False)


def message_ends(tokenizer, messages: list[dict[str, str]], ids: list[int]) -> list[int]:
    """Where in a conversation's ``ids`` each message before the last ends: the tokens it
    shares with the conversation cut after that message and followed by an empty user turn
    (a later request with the same system prompt, or the next turn, starts the same way; a
    template may refuse a conversation without a user turn, hence the empty one). A prefix
    the template refuses gives no boundary."""
    out = []
    for i in range(1, len(messages)):
        try:
            head = encode_messages(tokenizer, [*messages[:i], {"role": "user", "content": ""}])
        except PromptError:
            continue
        shared = next((j for j, (a, b) in enumerate(zip(head, ids, strict=False)) if a != b),
                      min(len(head), len(ids)))  # fmt: skip
        if shared not in out:
            out.append(shared)
    return out


def encode_with_ends(tokenizer, prompt: str, system: str | None = None,
                     ignore_template: bool = False) -> tuple[list[int], list[int]]:  # fmt: skip
    """``encode_prompt``'s ids and, through a chat template with a system prompt, where the
    system message ends (as the server finds it in the same conversation)."""
    ids = encode_prompt(tokenizer, prompt, system, ignore_template)
    if not system or ignore_template or not getattr(tokenizer, "chat_template", None):
        return ids, []
    return ids, message_ends(tokenizer, prompt_messages(prompt, system), ids)


def _check_utf8(what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable argv bytes arrive as lone surrogates
        raise PromptError(
            f"the {what} is not valid UTF-8 (at character {e.start}); pass UTF-8 text"
        ) from e
