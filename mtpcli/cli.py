"""The ``mtp`` command line. The only module that prints: text to stdout, the rest to stderr."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .errors import Interrupted, MtpError, OutputError, PipelineError, PromptError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Multi-token-prediction speculative decoding for Qwen3.5-family models on MLX.",
)
# Markup off: paths, names and config values in messages print as they are, brackets included;
# our own styles go in as ``style=``.
err = Console(stderr=True, highlight=False, markup=False)
state = {"debug": False, "stdin_closed": False}
F = TypeVar("F", bound=Callable)


DEBUG_HELP = "Show tracebacks on errors."


def _interruptible(command: F) -> F:
    """Ctrl-C inside a command becomes our ``Interrupted`` (exit 130, one line), the same on
    every Typer version (some turn it into a silent exit, some into exit 1); and the command
    takes ``--debug`` too (``mtp generate ... --debug`` as well as ``mtp --debug generate``)."""

    @functools.wraps(command)
    def wrapper(*args, debug: bool = False, **kwargs):
        state["debug"] = state["debug"] or debug
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise Interrupted("interrupted") from e

    sig = inspect.signature(command, eval_str=True)
    flag = inspect.Parameter(
        "debug", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
        default=typer.Option(False, "--debug", metavar="", help=DEBUG_HELP),
    )  # fmt: skip
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), flag])
    wrapper.__annotations__ = {**command.__annotations__, "debug": bool}
    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", metavar="", help=DEBUG_HELP)) -> None:
    state["debug"] = debug


def _read_prompt(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if state["stdin_closed"]:
        raise PromptError("no prompt: -p was not given and standard input is closed")
    if sys.stdin.isatty():
        err.print("reading the prompt from stdin (end with Ctrl-D)", style="dim")
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"the prompt on stdin is not valid UTF-8 (byte {e.start})") from e


@contextlib.contextmanager
def _stdout_errors() -> Iterator[None]:
    """A standard output that cannot take the text (a full disk, a closed pipe) is a named
    error; fd 1 then goes to /dev/null, so the interpreter's flush at exit fails no more."""
    try:
        yield
    except OSError as e:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        raise OutputError(f"cannot write to standard output: {e.strerror or e}") from e


def _write(text: str) -> None:
    """Text to stdout, flushed (so it streams)."""
    with _stdout_errors():
        sys.stdout.write(text)
        sys.stdout.flush()


def _note(msg: str) -> None:
    err.print(msg, style="dim", soft_wrap=True)


def _mtp_line(result) -> str:
    """What ran: MTP on (at which block, why) or off (and why)."""
    if result.draft_kind == "none":
        return "MTP: off (no drafter)"
    why = (
        f"gate: {result.expected_speedup:.2f}x expected"
        if result.expected_speedup is not None
        else "forced by --draft-kind mtp"
    )
    if result.mtp_engaged and result.mtp_from_context is not None:
        return (f"MTP: on from about {result.mtp_from_context} tokens of context, block "
                f"{result.block_size} ({why} at the prompt)")  # fmt: skip
    if result.mtp_engaged:
        return f"MTP: on, block {result.block_size} ({why})"
    return f"MTP: off ({why}; --draft-kind mtp runs it anyway)"


def _print_stats(result) -> None:
    stats = result.stats
    err.print("==========")
    err.print(f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
    err.print(
        f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec"
    )
    err.print(f"Peak memory: {stats.peak_memory_gb:.3f} GB")
    err.print(f"Draft kind: {result.draft_kind}")
    err.print(_mtp_line(result))
    r = stats.mtp
    if r is not None:
        per = " ".join(f"{a:.2f}" for a in r.acceptance_by_position)
        ms = 1000 / max(r.rounds, 1)
        blocks = ", ".join(f"{n} of block {b}" for b, n in sorted(r.rounds_by_block.items()))
        err.print(
            f"MTP: {r.rounds} rounds ({blocks or 'none'}), {r.drafted} drafted, {r.accepted} "
            f"accepted, acceptance {r.acceptance_rate:.3f} (by position: {per}), "
            f"{r.tokens_per_verify:.2f} tokens/verify"
            + (f", {r.ahead} built ahead (decided on the device)" if r.ahead else "")
        )
        if r.switches:
            err.print("MTP switched " + ", ".join(
                f"{'on' if on else 'off'} at {c} tokens of context" for c, on in r.switches
            ) + f" ({r.classic_steps} tokens by classic steps)")  # fmt: skip
        err.print(
            f"MTP time per round: draft {r.draft_s * ms:.2f} ms, verify {r.verify_s * ms:.2f} ms "
            f"({r.verify_build_s * ms:.2f} building it), rollback {r.rollback_s * ms:.2f} ms"
        )


DRAFT_QUANTIZE = typer.Option(
    None, "--draft-quantize", help="Quantize a bf16 drafter at load: 4 or 8 bits (group 64)."
)


@contextlib.contextmanager
def _status(console: Console | None = None) -> Iterator[Callable[[str], None]]:
    """A spinner line on stderr that the block updates with what it is doing; nothing where
    stderr is not a terminal (logs and pipes get no control sequences)."""
    console = console or err
    if not console.is_terminal:
        yield lambda msg: None
        return
    with console.status("") as status:
        yield lambda msg: status.update(Text(msg, style="dim"))


class PrefillBar:
    """A progress bar on stderr for a prompt long enough to take a while (more than one
    prefill chunk), gone once the prompt is in; nothing where stderr is not a terminal."""

    def __init__(self, console: Console | None = None):
        self.console, self.bar, self.task = console or err, None, None

    def __call__(self, done: int, total: int) -> None:
        from rich.progress import Progress

        from .models.qwen3_5 import PREFILL_CHUNK

        if self.bar is None:
            if total <= PREFILL_CHUNK or not self.console.is_terminal:
                return
            self.bar = Progress(console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prompt", total=total)
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.bar.stop()


def _load(model, draft_model, draft_kind, draft_block_size, draft_quantize, options):
    """The target and drafter a command runs: the built-in example without ``-m``."""
    from .config import check_block_size
    from .drafters.qwen3_5_mtp import check_quantize
    from .example import NOTE, ensure_example
    from .loading import load_pair

    if draft_block_size is not None:
        check_block_size(draft_block_size)  # before minutes of loading; generate() checks too
    if draft_quantize is not None:
        check_quantize(draft_quantize)
    if model is None:
        target_dir, example_drafter = ensure_example()
        model, draft_model = str(target_dir), draft_model or str(example_drafter)
        err.print(NOTE, style="yellow")
    if draft_block_size is not None and draft_model is None:
        raise UsageError("--draft-block-size needs --draft-model (a qwen3_5_mtp drafter)")
    if draft_block_size is not None and draft_kind == "none":
        raise UsageError("--draft-block-size sets MTP's rounds, and --draft-kind none turns "
                         "MTP off: drop one of them")  # fmt: skip
    if draft_quantize is not None and draft_model is None:
        raise UsageError("--draft-quantize needs --draft-model (a qwen3_5_mtp drafter)")
    with _status() as progress:
        return load_pair(model, draft_model, draft_kind, options, draft_quantize, progress)


@app.command()
@_interruptible
def generate(
    model: str | None = typer.Option(
        None,
        "-m",
        "--model",
        help="Target: directory or Hugging Face repo id (default: built-in example).",
    ),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="A standalone qwen3_5_mtp drafter: directory or repo id."
    ),
    draft_kind: str = typer.Option("auto", "--draft-kind", help="auto | mtp | none."),
    draft_block_size: int | None = typer.Option(
        None,
        "--draft-block-size",
        help="Tokens per round, pending token included (default: the drafter's block_size).",
    ),
    draft_quantize: int | None = DRAFT_QUANTIZE,
    prompt: str | None = typer.Option(
        None, "-p", "--prompt", help="Prompt text; '-' or absent reads stdin."
    ),
    max_tokens: int = typer.Option(
        256, "-n", "--max-tokens", min=1, help="Most tokens to generate."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample from the fewest tokens whose probabilities sum to this."
    ),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k likeliest tokens; 0: all."),
    min_p: float = typer.Option(
        0.0, "--min-p", help="Drop tokens less likely than this times the likeliest one."
    ),
    seed: int | None = typer.Option(
        None, "--seed", min=0, max=2**64 - 1, help="Seed for sampling (0 to 2^64 - 1)."
    ),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="A system message put before the prompt (chat template)."
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", metavar="", help="Encode the prompt as plain text."
    ),
    as_json: bool = typer.Option(
        False, "--json", metavar="", help="Print one JSON object instead of streaming."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", metavar="", help="Say what was loaded and decided."
    ),
    kernels: str = typer.Option(
        "auto",
        "--kernels",
        envvar="MTP_KERNELS",
        help="auto (native kernels after a self-check) | native | ops (reference only).",
    ),  # fmt: skip
    qmm: str = typer.Option(
        "auto",
        "--qmm",
        envvar="MTP_QMM",
        help="Quantized matmul: auto (ours on CUDA, where it measured faster; MLX's elsewhere)"
        " | mlx (MLX's own) | ours (one weight read for 1-32 rows).",
    ),  # fmt: skip
) -> None:
    """Generate text, with MTP speculative decoding when a drafter is given."""
    from .engine.sampling import SamplingParams
    from .generation import generate as run_generate
    from .options import Options

    sampling = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    loaded = _load(model, draft_model, draft_kind, draft_block_size, draft_quantize,
                   Options(kernels=kernels, qmm=qmm))  # fmt: skip
    stage = loaded.target.stage
    if stage is not None and (prompt is None or prompt == "-"):
        raise PipelineError("under mlx.launch the prompt comes with --prompt: standard input "
                            "reaches every process and is never closed")  # fmt: skip
    text = _read_prompt(prompt)
    if stage is not None:  # mlx.launch ends every process once one has ended
        signal.signal(signal.SIGTERM, _pipeline_ended)
    if stage is not None and stage.rank != 0:  # in a pipeline, rank 0 speaks for all
        with _pipeline_errors():
            run_generate(loaded, text, max_tokens=max_tokens, sampling=sampling,
                         block_size=draft_block_size, force_mtp=draft_kind == "mtp",
                         system_prompt=system_prompt, chat_template=not ignore_chat_template,
                         seed=seed)  # fmt: skip
        return
    if verbose:
        err.print(
            f"target {loaded.target_dir}; drafter {loaded.drafter_dir}; kind {loaded.draft_kind}"
        )

    def stream(segment: str) -> None:
        if not as_json:
            _write(segment)

    def decided(decision) -> None:
        if verbose or not decision.engaged:
            err.print(f"MTP gate: {decision.reason}", style="dim")

    with _pipeline_errors() if stage is not None else contextlib.nullcontext():
        result = run_generate(
            loaded, text, max_tokens=max_tokens, sampling=sampling, block_size=draft_block_size,
            force_mtp=draft_kind == "mtp", system_prompt=system_prompt,
            chat_template=not ignore_chat_template, seed=seed, on_text=stream, note=_note,
            on_decision=decided, on_prefill=PrefillBar(),
        )  # fmt: skip
    if as_json:
        _write(json.dumps(result.as_dict()) + "\n")
    else:
        _write("\n")
        _print_stats(result)


@contextlib.contextmanager
def _pipeline_errors():
    """A lost connection between the pipeline's processes, as MLX's ring reports it (a
    RuntimeError), becomes a named error."""
    try:
        yield
    except RuntimeError as e:
        if "[ring]" not in str(e):
            raise
        # mlx.launch stops this process next (SIGTERM): the error is reported once, whole
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise PipelineError(f"the pipeline lost a process ({e}); its error, if it had one, is "
                            "above") from e  # fmt: skip


def _pipeline_ended(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut this error's report
    raise PipelineError("another process of the pipeline ended, so mlx.launch stopped this "
                        "one; its error is above")  # fmt: skip


@app.command()
@_interruptible
def serve(
    model: str | None = typer.Option(
        None, "-m", "--model", help="Target: directory or repo id (default: built-in example)."
    ),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="A standalone qwen3_5_mtp drafter: directory or repo id."
    ),
    draft_kind: str = typer.Option("auto", "--draft-kind", help="auto | mtp | none."),
    draft_block_size: int | None = typer.Option(
        None, "--draft-block-size", help="Tokens per round (default: the gate's choice)."
    ),
    draft_quantize: int | None = DRAFT_QUANTIZE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    model_name: str | None = typer.Option(
        None, "--model-name", help="The id clients ask for (default: -m as given, or 'example')."
    ),
    max_tokens: int = typer.Option(
        256, "--max-tokens", min=1, help="Tokens a request gets when it names no max_tokens."
    ),
    kernels: str = typer.Option(
        "auto", "--kernels", envvar="MTP_KERNELS", help="auto | native | ops, as for generate."
    ),  # fmt: skip
    qmm: str = typer.Option(
        "auto", "--qmm", envvar="MTP_QMM", help="auto | mlx | ours, as for generate."
    ),  # fmt: skip
    prompt_cache_bytes: int = typer.Option(
        2 << 30,
        "--prompt-cache-bytes",
        min=0,
        help="Memory for snapshots of processed prompts, reused by requests that start the "
        "same way (0: off).",
    ),  # fmt: skip
    max_batch: int = typer.Option(
        1,
        "--max-batch",
        min=1,
        max=64,
        help="Requests that decode together, each joining and leaving between steps: in "
        "classic steps, or in MTP rounds with --draft-kind mtp (1: one at a time, with MTP "
        "where the gate engages it). Tokens are those each request decodes alone.",
    ),  # fmt: skip
    prompts_inline: bool = typer.Option(
        False,
        "--prompts-inline",
        help="With --max-batch: process a joining request's prompt while the batch waits, "
        "rather than on a thread of its own beside the batch's steps (for comparison).",
    ),  # fmt: skip
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API.

    Ctrl-C (exit 130) or SIGTERM (exit 0) stops it: a decoding request ends at its next token
    with a last event (finish_reason "cancelled", then [DONE]), queued requests get a 503, and
    the process exits within 5 seconds."""
    from .models.pipeline import launched, rank
    from .options import Options
    from .serve import check_port, follow
    from .serve import serve as run_server

    split = launched()
    if split and max_batch > 1:
        raise PipelineError("--max-batch above 1 runs in one process: under mlx.launch the "
                            "ranks decode one request at a time")  # fmt: skip
    if max_batch > 1 and draft_block_size is not None and draft_kind != "mtp":
        raise UsageError("--max-batch above 1 decodes classic steps unless MTP is forced: give "
                         "--draft-kind mtp with --draft-block-size")  # fmt: skip
    if not split or rank() == 0:  # in a pipeline rank 0 serves HTTP, the others follow it
        check_port(host, port)  # before minutes of loading
    loaded = _load(model, draft_model, draft_kind, draft_block_size, draft_quantize,
                   Options(kernels=kernels, qmm=qmm))  # fmt: skip
    stage = loaded.target.stage
    if stage is not None and stage.rank != 0:
        with _pipeline_errors():
            follow(loaded, draft_block_size, draft_kind == "mtp")
        return
    if stage is not None:
        _note("in a pipeline: one request at a time, the prompt cache off")
    stopped_by = run_server(
        loaded, model_name or model or "example", host=host, port=port,
        block_size=draft_block_size, force_mtp=draft_kind == "mtp",
        default_max_tokens=max_tokens, note=_note, prompt_cache_bytes=prompt_cache_bytes,
        max_batch=max_batch, prompts_inline=prompts_inline,
    )  # fmt: skip
    if stopped_by == signal.SIGINT:
        raise Interrupted("interrupted")


@app.command("inspect-weights")
@_interruptible
def inspect_weights(
    path: str = typer.Argument(..., help="Checkpoint directory or Hugging Face repo id."),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object."),
) -> None:
    """Describe a checkpoint from its headers: layout, tensors, MTP head, drafter use."""
    from .inventory import describe
    from .loading import resolve_path

    info = describe(resolve_path(path, "checkpoint"))
    if as_json:
        _write(json.dumps(info) + "\n")
        return
    table = Table(title=f"mtp inspect-weights {path}", show_header=False)
    for key in ("model_type", "layout", "dtypes", "quantization", "tensor_count", "total_bytes",
                "mtp_tensor_count", "mtp_layout", "block_size", "config_mtp_layers"):  # fmt: skip
        table.add_row(key, str(info[key]))
    table.add_row("mtp tensors", "\n".join(info["mtp_tensors"]) or "-")
    table.add_row("+1.0 norm shift", "\n".join(info["norm_shift"]) or "-")
    ok = Text("yes", style="green") if info["drafter_ok"] else Text("no", style="red")
    table.add_row("usable as --draft-model", Text.assemble(ok, f": {info['reason']}"))
    if info["mtp_claim_unbacked"]:
        table.add_row(
            "note",
            f"config says mtp_num_hidden_layers={info['config_mtp_layers']}, but the weights "
            "hold no MTP tensors",
        )
    with _stdout_errors():
        Console(markup=False).print(table)


@app.command("extract-drafter")
@_interruptible
def extract_drafter_cmd(
    src: Path = typer.Argument(..., help="A raw Hugging Face checkpoint with mtp.* tensors."),
    out: Path = typer.Argument(..., help="Directory to write the standalone drafter to."),
    block_size: int | None = typer.Option(
        None, "--block-size", help="Default block size to record (mtp layers + 2 if not given)."
    ),
    quantize: int | None = typer.Option(
        None, "--quantize", help="Write the drafter quantized to 4 or 8 bits (affine)."
    ),
    group_size: int = typer.Option(64, "--group-size", help="With --quantize: 32, 64 or 128."),
) -> None:
    """Split the MTP head of a raw checkpoint into a standalone qwen3_5_mtp drafter."""
    from .extract import extract_drafter
    from .loading import resolve_path

    state["flags"] = {"block_size": "--block-size"}
    written = extract_drafter(resolve_path(str(src), "checkpoint"), out, block_size, quantize,
                              group_size)  # fmt: skip
    err.print(f"wrote drafter to {written}")


@app.command()
@_interruptible
def bench(
    model: str | None = typer.Option(
        None, "-m", "--model", help="Target (default: built-in example)."
    ),
    draft_model: str | None = typer.Option(None, "--draft-model", help="qwen3_5_mtp drafter."),
    synthetic: str | None = typer.Option(
        None,
        "--synthetic",
        help="Random weights of a real shape, built in memory: qwen3.8-27b, qwen3.5-small, "
        "qwen3.5-35b-a3b (MoE), tiny, tiny-moe, qwen3.8-27b-layers and qwen3.5-35b-a3b-layers "
        "(the layer counts and routing at tiny widths).",
    ),
    bits: int = typer.Option(4, "--bits", help="With --synthetic: 4, 8 or 16 (bf16)."),
    block_size: list[int] = typer.Option([3], "--block-size", help="MTP block size; repeatable."),
    repeats: int = typer.Option(5, "--repeats", min=1),
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", min=1),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help="One prompt per line (a JSON string for one with newlines)."
    ),
    simulate_acceptance: float | None = typer.Option(
        None,
        "--simulate-acceptance",
        help="Swap each draft for the target's own token with this probability.",
    ),
    peers: bool = typer.Option(
        False,
        "--peers",
        metavar="",
        help="Also run mlx-lm's decoding and, for checkpoints on disk, mlx-vlm's MTP, on the "
        "same weights.",
    ),
    verify_table: bool = typer.Option(
        True, "--verify-table/--no-verify-table", metavar="", help="Time T = 1..8 forwards."
    ),
    gate_check: bool = typer.Option(
        True,
        "--gate-check/--no-gate-check",
        metavar="",
        help="Calibrate the gate and show its predicted speedups beside the measured ones.",
    ),  # fmt: skip
    draft_quantize: list[int] = typer.Option(
        [],
        "--draft-quantize",
        help="Also run MTP arms with the drafter quantized to 4 or 8 "
        "bits (repeatable), beside the drafter as loaded.",
    ),  # fmt: skip
    context: list[int] = typer.Option(
        [],
        "--context",
        help="Run the arms after a prompt of this many tokens instead (repeatable), beside MTP "
        "whose rounds the gate chooses, with the gate's prediction at that length.",
    ),  # fmt: skip
    rounds_read_first: bool = typer.Option(
        False,
        "--rounds-read-first",
        metavar="",
        help="Also run MTP arms that read each round before building the next, beside the "
        "rounds built ahead.",
    ),  # fmt: skip
    out: Path | None = typer.Option(None, "--out", help="Write Markdown and JSON here."),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object."),
    kernels: str = typer.Option(
        "auto", "--kernels", envvar="MTP_KERNELS", help="auto | native | ops, as for generate."
    ),  # fmt: skip
    qmm: str = typer.Option(
        "auto", "--qmm", envvar="MTP_QMM", help="auto | mlx | ours, as for generate."
    ),
) -> None:
    """Classic vs MTP decoding side by side, with the verify-cost table (medians, min-max)."""
    state["flags"] = {"block_size": "--block-size", "context": "--context"}
    from rich.progress import Progress

    from . import bench as B
    from .example import NOTE
    from .files import why, writable_dir
    from .models.pipeline import launched, rank
    from .options import Options

    split = launched()
    if split and (synthetic or peers or context):
        raise PipelineError("under mlx.launch, mtp bench runs the built-in example or a "
                            "checkpoint from disk (-m), without --synthetic (every process "
                            "would build the whole model), --peers (they run in one process) "
                            "or --context (its gate times each process apart)")  # fmt: skip
    if split:  # mlx.launch ends every process once one has ended
        signal.signal(signal.SIGTERM, _pipeline_ended)
    quiet = split and rank() != 0  # in a pipeline, rank 0 speaks for all
    options = Options(kernels=kernels, qmm=qmm)
    if quiet:
        with _pipeline_errors():
            B.run(model, draft_model, blocks=block_size, repeats=repeats,
                  max_tokens=max_tokens, prompts_file=prompts_file, simulate=simulate_acceptance,
                  verify_table=verify_table, draft_quantize=draft_quantize,
                  read_first=rounds_read_first, check_gate=gate_check, options=options)  # fmt: skip
        return
    if out is not None:
        writable_dir(out)  # before the run, whose results would otherwise be lost
    if model is None and not synthetic:
        err.print(NOTE, style="yellow")
    t0 = time.perf_counter()
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("bench", total=None)

        def progress(msg: str) -> None:
            bar.update(task, description=escape(msg))  # the column reads it as markup
            if not err.is_terminal:  # logs of long runs show how far they got
                err.print(f"[{time.perf_counter() - t0:7.1f}s] {msg}")

        with _pipeline_errors() if split else contextlib.nullcontext():
            doc = B.run(
                model, draft_model, synthetic=synthetic, bits=bits, blocks=block_size,
                repeats=repeats, max_tokens=max_tokens, prompts_file=prompts_file,
                simulate=simulate_acceptance, peers=peers, verify_table=verify_table,
                draft_quantize=draft_quantize, contexts=context, read_first=rounds_read_first,
                check_gate=gate_check, options=options,
                command="mtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]), progress=progress,
            )  # fmt: skip
    markdown = B.markdown(doc)
    if out is not None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            (out / f"bench-{stamp}.json").write_text(json.dumps(doc, indent=1))
            (out / f"bench-{stamp}.md").write_text(markdown)
        except OSError as e:
            raise OutputError(f"cannot write the results under {out}: {why(e)}") from e
        err.print(f"wrote {out}/bench-{stamp}.md and .json")
    if as_json:
        _write(json.dumps(doc) + "\n")
    elif sys.stdout.isatty():
        from rich.markdown import Markdown

        with _stdout_errors():
            Console().print(Markdown(markdown))
    else:  # to a file or a pipe: the report itself (Rich would cut its tables at 80 columns)
        _write(markdown)


# The flag of each API input an error can be about (``MtpError.param``).
FLAGS = {"temp": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "max_tokens": "--max-tokens", "block_size": "--draft-block-size",
         "force_mtp": "--draft-kind mtp", "kernels": "--kernels", "qmm": "--qmm"}  # fmt: skip


def run(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code. Our errors become one red line on stderr; usage
    errors get Typer's own message and exit 2; Ctrl-C exits 130."""
    try:
        app(args=argv, prog_name="mtp")  # standalone: Typer reports its usage errors itself
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MtpError as e:
        if state["debug"]:
            raise
        flags = FLAGS | state.get("flags", {})  # a command's own names for its inputs
        _error(f"{flags.get(e.param, e.param)} {e.message}" if e.param else str(e))
        return e.exit_code
    except KeyboardInterrupt:  # outside a command: while parsing or importing
        _error("interrupted")
        return 130


def _error(message: str) -> None:
    """One red ``error:`` line on stderr; the message printed as it is (never as markup)."""
    err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _guard_std_streams() -> None:
    """A closed stdin, stdout or stderr (``<&-``, ``>&-``) leaves its descriptor free, and
    the next file opened (a weights file) would take it: hold each with /dev/null."""
    closed = [fd for fd in (0, 1, 2) if not _is_open(fd)]
    for fd in closed:
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    if 2 in closed:
        sys.stderr = err.file = open(2, "w", closefd=False)  # noqa: SIM115 - for the process
    state["stdin_closed"] = 0 in closed
    if 1 in closed:
        raise OutputError(
            "standard output is closed (>&-): there is nowhere to write the output; "
            "redirect it to a file or /dev/null instead"
        )


def main() -> None:
    try:
        _guard_std_streams()
    except OutputError as e:
        _error(str(e))
        sys.exit(e.exit_code)
    sys.exit(run())


if __name__ == "__main__":
    main()
