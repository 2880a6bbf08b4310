"""``mtp serve``: an OpenAI-compatible HTTP server over the engine ``mtp generate`` runs.

``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events or not),
``/v1/models`` and ``/health``. Each request goes through ``generation.generate``: the same
prompt encoding, gate, engines and exactness as the CLI. One request decodes at a time (or,
with ``--max-batch``, up to that many together: in classic steps, ``engine/batch.py``, or with
MTP forced in MTP rounds, ``engine/mtp_batch.py``), on the
main thread (MLX's work stays on one thread); the others wait in a queue, and the HTTP side
(Starlette on uvicorn, in a thread of its own) only parses, queues and relays. A prompt cache
(``engine/prompt_cache.py``) lets a request that starts as an earlier one did (a shared system
prompt, the next turn of a chat) skip processing that part, with the tokens of a cold start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from .engine import check_room
from .engine.batch import Batch, Started
from .engine.mtp_batch import MTPBatch
from .engine.prompt_cache import PromptCache
from .engine.sampling import SamplingParams
from .errors import ContextTooLongError, MtpError, SamplingError, ServeError, UsageError
from .gate import GateDecision
from .generation import GenerateResult, TextOut, generate
from .loading import Loaded
from .models.pipeline import share, share_flag
from .tokenizer import encode_messages, encode_prompt, message_ends

MAX_STOPS = 4  # as OpenAI's API
MAX_BODY_BYTES = 8 << 20
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request looks for its client
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
STOP_BOUND_S = 5.0  # Ctrl-C or SIGTERM: running streams ended and the process gone within this


class BadRequest(Exception):
    """A request the server refuses: its HTTP status, OpenAI error type, message and field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code,
        )  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass
class Job:
    """One request's decoding: what to decode, and the events it yields to its handler."""

    ids: list[int]
    boundaries: list[int]  # token positions where the request's messages end
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    next_poll: float = 0.0  # monotonic time at which the handler next looks for its client

    def put(self, kind: str, value: Any = None) -> None:
        """From the decoding thread: hand an event to the handler's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class DecodeTime:
    """Where the decoding thread's time went (``/health``), in seconds since the server
    started: waiting on prompts (processed while the batch waited, or joining), the batch's
    steps (queueing the next and reading the last), and relaying their tokens as text; and how
    many prompts were processed beside the steps, on the prompt thread."""

    prompts_beside: int = 0
    prompts_s: float = 0.0
    steps: int = 0
    steps_s: float = 0.0
    relay_s: float = 0.0


class Decoder:
    """Decodes queued jobs with a loaded pair (``run`` on the main thread): one at a time
    through ``generate`` (the gate, MTP), or with ``max_batch`` above 1 up to that many at once
    in classic steps (``engine/batch.py``), or, MTP forced, in MTP rounds of the block size
    asked for or the drafter's (``engine/mtp_batch.py``), each joining and leaving between
    steps."""

    def __init__(self, loaded: Loaded, block_size: int | None = None, force_mtp: bool = False,
                 note: Callable[[str], None] = lambda msg: None,
                 prompt_cache_bytes: int = 0, max_batch: int = 1,
                 prompts_inline: bool = False):  # fmt: skip
        self.loaded, self.block_size, self.force_mtp = loaded, block_size, force_mtp
        # A batch's joining prompts are processed on a thread of their own (one at a time, on
        # a stream of that thread) while the batch steps; inline, the batch waits for each.
        self.prompts_inline = prompts_inline
        self.prompt_stream = mx.new_thread_local_stream(mx.default_device())
        self.note = note
        # In a pipeline (mlx.launch) every rank decodes each job (``follow``): rank 0 hands
        # each one on, and whether it was cancelled at each token. The prompt cache is off
        # there (each rank's snapshots hold its own layers, so their sizes, and the evictions,
        # would differ from rank to rank).
        self.stage = loaded.target.stage
        if self.stage is not None:
            prompt_cache_bytes = 0
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        # MTP rounds of a batch: forced, with a drafter (the gate times one request alone)
        self.rounds = force_mtp and loaded.drafter is not None and max_batch > 1
        self.block = block_size or (loaded.drafter.block_size if loaded.drafter else 1)
        cap, self.round_rows = loaded.target.batch_rows, None
        if self.rounds:  # each position of a round's block is a row of the products
            shape = MTPBatch(loaded.target, loaded.drafter, self.block)
            cap, self.round_rows = shape.max_rows, shape.round_rows
        if cap is not None and max_batch > cap:
            note(f"--max-batch {max_batch}: this target decodes at most {cap} requests together "
                 "exactly on this backend" + (f" in rounds of {self.block}" if self.rounds else "")
                 + ("; one at a time" if cap <= 1 else ""))  # fmt: skip
            max_batch = max(cap, 1)
            self.rounds = self.rounds and max_batch > 1
        self.max_batch = max_batch
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.served = 0
        self.cancelled = 0
        self.stopping = False
        self.running: list[Job] = []
        self.time = DecodeTime()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    @property
    def concurrency(self) -> str:
        """How jobs decode, as ``/health`` says it."""
        if self.max_batch == 1:
            return "one request decodes at a time; the others wait in a queue"
        how = "classic steps"
        if self.rounds:
            how = f"MTP rounds of {self.block}"
            if self.round_rows:
                how += f" while requests x block <= {self.round_rows}, else one token a row"
        return (
            f"up to {self.max_batch} requests decode together in {how}; the others wait in a queue"
        )

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def run(self, keep_going: Callable[[], bool]) -> None:
        if self.max_batch > 1:
            self._run_batched(keep_going)
            return
        while keep_going() and not self.stopping:
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            self.running = [job]
            try:
                self.decode(job)
            finally:
                self.running = []

    def _run_batched(self, keep_going: Callable[[], bool]) -> None:
        """Decode up to ``max_batch`` jobs at once: queued ones join between steps (each prompt
        processed alone on the prompt thread while the batch steps, or inline where nothing
        decodes or ``prompts_inline``), each leaves at its end, and a job whose client left is
        dropped at the next step."""
        if self.rounds:
            batch = MTPBatch(self.loaded.target, self.loaded.drafter, self.block)
            reason = (f"forced: up to {self.max_batch} requests decode together in MTP rounds "
                      f"of {self.block} while the round's rows are few enough to pay "
                      "(MTPBatch.round_rows), else one token a row (--max-batch)")  # fmt: skip
        else:
            batch = Batch(self.loaded.target)
            reason = (f"off: up to {self.max_batch} requests decode together in classic steps "
                      "(--max-batch)")  # fmt: skip
        decision = GateDecision(self.rounds, self.block_size or self.block, reason, None)
        spent = self.time
        starting: collections.deque[tuple[Job, TextOut, Future]] = collections.deque()
        prompts = ThreadPoolExecutor(1, thread_name_prefix="mtp-prompts")
        try:
            while keep_going() and (batch.rows or starting or not self.stopping):
                while len(batch.rows) + len(starting) < self.max_batch and not self.stopping:
                    try:
                        job = self.jobs.get(timeout=0 if batch.rows or starting else 0.1)
                    except queue.Empty:
                        break
                    if job.cancel.is_set():  # its client left while it waited
                        self.cancelled += 1
                        continue
                    self.running.append(job)
                    if self.stopping:  # (``stop`` came after the wait: it missed this one)
                        job.cancel.set()
                    text = TextOut(self.loaded.tokenizer, job.stop,
                                   lambda t, job=job: job.put("text", t))  # fmt: skip
                    # beside the batch's steps (and after the prompts already there)
                    if (batch.rows or starting) and not self.prompts_inline:
                        starting.append((job, text, prompts.submit(self._start, batch, job, text)))
                        spent.prompts_beside += 1
                        continue
                    t0 = time.perf_counter()  # nothing decodes meanwhile: the batch waits
                    self._join(batch, job, text, partial(self._start, batch, job, text, False))
                    spent.prompts_s += time.perf_counter() - t0
                # prompts processed beside join in turn once done (a batch with no rows waits
                # for the first); one whose job was cancelled before it began is dropped
                while starting:
                    job, text, done = starting[0]
                    if job.cancel.is_set() and done.cancel():
                        starting.popleft()
                        self._left(job)
                        continue
                    if batch.rows and not done.done():
                        break
                    starting.popleft()
                    t0 = time.perf_counter()
                    self._join(batch, job, text, done.result)
                    spent.prompts_s += time.perf_counter() - t0
                if batch.rows:
                    self._step(batch, decision)
        finally:  # the prompt begun ends; the others never begin, and their jobs get a 503
            prompts.shutdown(wait=True, cancel_futures=True)
            for job, _, _ in starting:
                job.put("error", _shutting_down())
        self.running = []

    def _start(self, batch: Batch | MTPBatch, job: Job, text: TextOut,
               beside: bool = True) -> Started:  # fmt: skip
        """A job's prompt processed alone (``beside``: on this thread's own stream)."""
        with mx.stream(self.prompt_stream) if beside else contextlib.nullcontext():
            return batch.start(job.ids, owner=(job, text), max_tokens=job.max_tokens,
                               sampling=job.sampling, seed=job.seed, eos_ids=self.loaded.eos,
                               prompt_cache=self.prompt_cache,
                               boundaries=job.boundaries)  # fmt: skip

    def _join(self, batch: Batch | MTPBatch, job: Job, text: TextOut,
              started: Callable[[], Started]) -> None:  # fmt: skip
        """Add ``job`` to ``batch`` once ``started`` gives its processed prompt, or answer it at
        once: a bad request, or a job cancelled meanwhile (``_left``)."""
        try:
            ready = started()
            if job.cancel.is_set():
                self._left(job)
                return
            batch.join(ready)
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the others
            self.running.remove(job)
            job.put("error", _failed(e))

    def _left(self, job: Job) -> None:
        """A job cancelled before it joined: its client left, or the server is stopping (then
        a 503, as the queued jobs get)."""
        self.running.remove(job)
        if self.stopping:
            job.put("error", _shutting_down())
        else:
            self.cancelled += 1

    def _step(self, batch: Batch | MTPBatch, decision: GateDecision) -> None:
        """One step of ``batch``: each row's tokens relayed as text, the rows that ended
        answered and dropped."""
        spent = self.time
        t0 = time.perf_counter()
        emitted = batch.step()
        t1 = time.perf_counter()
        ended = []
        for e in emitted:
            job, text = e.row.owner
            finish, done = None, e.ended
            if job.cancel.is_set():
                finish, done = "cancelled", True
            elif any(text.add(t) for t in e.tokens):  # (stops at the first that stops)
                finish, done = "stop", True
            if done:
                ended.append(e.row)
                result = text.result(self.loaded, finish, job.max_tokens, e.row.stats,
                                     decision)  # fmt: skip
                self._finished(job, result)
        batch.drop(ended)
        gone = {id(r.owner[0]) for r in ended}
        self.running = [j for j in self.running if id(j) not in gone]
        spent.steps += 1
        spent.steps_s += t1 - t0
        spent.relay_s += time.perf_counter() - t1

    def _finished(self, job: Job, result: GenerateResult) -> None:
        self.served += 1
        self.cancelled += result.finish_reason == "cancelled"
        job.put("done", result)

    def stop(self) -> None:
        """Stop taking jobs; those decoding end at their next token (from a signal handler)."""
        self.stopping = True
        for job in list(self.running):
            job.cancel.set()

    def refuse_queued(self) -> None:
        """Answer every job still queued with a 503 (the server is stopping)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.put("error", _shutting_down())

    def decode(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while the job waited
            self.cancelled += 1
            return
        cancelled = job.cancel.is_set
        if self.stage is not None:
            share(self.stage, json.dumps(_job_fields(job)).encode())
            stage = self.stage
            cancelled = lambda: share_flag(stage, job.cancel.is_set())  # noqa: E731
        try:
            result = generate(
                self.loaded, job.ids, max_tokens=job.max_tokens, sampling=job.sampling,
                block_size=self.block_size, force_mtp=self.force_mtp, seed=job.seed,
                stop=job.stop, cancelled=cancelled,
                on_text=lambda text: job.put("text", text), note=self.note,
                prompt_cache=self.prompt_cache, boundaries=job.boundaries,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            job.put("error", _failed(e))
            return
        self._finished(job, result)

    def release(self) -> None:
        """In a pipeline: tell the other ranks that no job will come (they exit)."""
        if self.stage is not None:
            with contextlib.suppress(RuntimeError):  # a rank already gone
                share(self.stage, None)


def _job_fields(job: Job) -> dict:
    """What every rank of a pipeline needs to decode ``job`` as rank 0 does."""
    s = job.sampling
    return {"ids": job.ids, "boundaries": job.boundaries, "max_tokens": job.max_tokens,
            "seed": job.seed, "stop": job.stop,
            "sampling": {"temp": s.temp, "top_p": s.top_p, "top_k": s.top_k,
                         "min_p": s.min_p}}  # fmt: skip


def follow(loaded: Loaded, block_size: int | None = None, force_mtp: bool = False) -> None:
    """A pipeline rank other than 0 under ``mtp serve``: decode each job rank 0 hands on, in
    step with it (the same tokens; its text goes nowhere), until rank 0 says no more will come.
    A signal is left to rank 0, which ends the running job and then the others."""
    stage = loaded.target.stage
    assert stage is not None and not stage.last, "rank 0 serves; the others follow"
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while (data := share(stage)) is not None:
        f = json.loads(data)
        with contextlib.suppress(MtpError):  # rank 0 answers it; this rank goes on
            generate(loaded, f["ids"], max_tokens=f["max_tokens"],
                     sampling=SamplingParams(**f["sampling"]), block_size=block_size,
                     force_mtp=force_mtp, seed=f["seed"], stop=f["stop"],
                     cancelled=lambda: share_flag(stage, False),
                     boundaries=f["boundaries"])  # fmt: skip


def _shutting_down() -> BadRequest:
    return BadRequest(503, "the server is shutting down; send the request again once it is "
                      "back", kind="server_error", code="server_shutting_down")  # fmt: skip


def _failed(e: Exception) -> BadRequest:
    """The answer to a request whose decoding raised ``e``."""
    if isinstance(e, MtpError):
        bad = isinstance(e, UsageError)
        return BadRequest(400 if bad else 500, str(e),
                          kind="invalid_request_error" if bad else "server_error")  # fmt: skip
    return BadRequest(500, f"decoding failed: {type(e).__name__}: {e}", kind="server_error")


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(400, f"'{name}' must be an integer in [{low}, {high}], got {value!r}",
                         name)  # fmt: skip
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(400, f"'{name}' must be a number, got {value!r}", name)
    return float(value)


# The request field of each generate() input an error can be about.
FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "max_tokens": "max_tokens"}  # fmt: skip


def _refused(e: MtpError, status: int = 400, **kw) -> BadRequest:
    """Our error as the request's refusal, worded with the request's field names."""
    field = FIELDS.get(e.param or "", e.param)
    message = f"'{field}' {e.message}" if field else str(e)
    return BadRequest(status, message, kw.pop("param", field), **kw)


def _sampling(body: dict) -> SamplingParams:
    """temperature, top_p, top_k and min_p: numbers here, their ranges SamplingParams' own."""
    temp, top_p = _number(body, "temperature", 0.0), _number(body, "top_p", 1.0)
    min_p, top_k = _number(body, "min_p", 0.0), _int(body, "top_k", 0, 0, 2**31 - 1)
    try:
        return SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    except SamplingError as e:
        raise _refused(e) from e


def _stream_fields(body: dict) -> None:
    """``stream`` a boolean and ``stream_options`` an object whose include_usage is one."""
    if body.get("stream") not in (None, True, False):
        raise BadRequest(400, f"'stream' must be true or false, got {body['stream']!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise BadRequest(400, "'stream_options' must be an object such as "
                         '{"include_usage": true}', "stream_options")  # fmt: skip


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(400, f"'stop' holds at most {MAX_STOPS} strings", "stop")
    return stops


# Features this server does not have, with the value that asks for none of them: a request
# that asks for one is refused rather than answered without it.
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}  # fmt: skip


def _unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) for v in off):
            raise BadRequest(400, f"'{name}' is not supported by this server; leave it out",
                             name)  # fmt: skip
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest(400, "only plain text output is supported: 'response_format' must be "
                         '{"type": "text"} or left out', "response_format")  # fmt: skip


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: the text ones, in order
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(400, f"messages[{i}]: only text content parts are supported",
                                 "messages")  # fmt: skip
            content = "".join(str(p.get("text", "")) for p in content)
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise BadRequest(400, f"messages[{i}] needs a role (system, user or assistant) and "
                             "text content", "messages")  # fmt: skip
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


class Server:
    """The HTTP side: parses requests into jobs for the ``Decoder`` and relays its events."""

    def __init__(self, decoder: Decoder, model_id: str, default_max_tokens: int = 256):
        self.decoder, self.model_id, self.default_max_tokens = decoder, model_id, default_max_tokens
        self.created = int(time.time())

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])  # fmt: skip

    async def health(self, request):
        from starlette.responses import JSONResponse

        d, loaded = self.decoder, self.decoder.loaded
        return JSONResponse({
            "status": "ok", "model": self.model_id, "draft_kind": loaded.draft_kind,
            "draft_model": str(loaded.drafter_dir) if loaded.drafter_dir else None,
            "decoding": d.busy, "rows": len(d.running), "max_batch": d.max_batch,
            "queued": d.jobs.qsize(), "served": d.served, "cancelled": d.cancelled,
            "concurrency": d.concurrency,
            "prompt_cache": _prompt_cache(d.prompt_cache),
            "time": asdict(d.time) if d.max_batch > 1 else None,
        })  # fmt: skip

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mtp"}
        ]})  # fmt: skip

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def _body(self, request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"the request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise BadRequest(400, "the request body is JSON nested too deeply") from e
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        return body

    async def _job(self, request, chat: bool) -> tuple[Job, dict]:
        from starlette.concurrency import run_in_threadpool

        body = await self._body(request)
        model = body.get("model")
        if model != self.model_id:
            raise BadRequest(404, f"the model {model!r} is not served here; GET /v1/models lists "
                             f"{self.model_id!r}", "model", code="model_not_found")  # fmt: skip
        if _int(body, "n", 1, 1, 1_000_000) != 1:
            raise BadRequest(400, "'n' must be 1: one completion per request", "n")
        _unsupported(body)
        limit = self.decoder.loaded.target.config.text.max_position_embeddings
        max_tokens = _int(body, "max_completion_tokens", None, 1, limit)
        max_tokens = max_tokens or _int(body, "max_tokens", self.default_max_tokens, 1, limit)
        sampling = _sampling(body)
        seed, stop = _int(body, "seed", None, 0, 2**63 - 1), _stops(body)
        _stream_fields(body)
        tokenizer = self.decoder.loaded.tokenizer
        if chat:
            messages = _messages(body)

            def encode() -> tuple[list[int], list[int]]:
                ids = encode_messages(tokenizer, messages)
                return ids, message_ends(tokenizer, messages, ids)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest(400, "'prompt' must be a non-empty string", "prompt")

            def encode() -> tuple[list[int], list[int]]:
                return encode_prompt(tokenizer, prompt, ignore_template=True), []

        try:
            ids, boundaries = await run_in_threadpool(encode)
            check_room(self.decoder.loaded.target, len(ids), max_tokens)
        except ContextTooLongError as e:
            raise _refused(e, param="messages" if chat else "prompt",
                           code="context_length_exceeded") from e  # fmt: skip
        except MtpError as e:
            raise BadRequest(400, str(e), "messages" if chat else "prompt") from e
        if not ids:
            raise BadRequest(400, "the prompt encodes to no tokens", "prompt")
        job = Job(ids, boundaries, max_tokens, sampling, seed, stop, asyncio.get_running_loop())
        return job, body

    async def _complete(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            job, body = await self._job(request, chat)
        except BadRequest as e:
            return JSONResponse(e.body(), status_code=e.status)
        self.decoder.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        # The first event before any answer: a job refused while queued (the server stopping)
        # gets its status, streamed or not.
        first = await self._next(request, job)
        if first is None:
            return JSONResponse({}, status_code=499)  # the client left; nobody reads this
        if first[0] == "error":
            return JSONResponse(first[1].body(), status_code=first[1].status)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(job, first, rid, chat, usage),
                                     media_type="text/event-stream")  # fmt: skip
        event = first
        while True:
            kind, value = event
            if kind == "error":
                return JSONResponse(value.body(), status_code=value.status)
            if kind == "done":
                break
            event = await self._next(request, job)
            if event is None:
                return JSONResponse({}, status_code=499)
        result: GenerateResult = value
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return JSONResponse(self._envelope(rid, chat, False) | {
            "choices": [choice], "usage": _usage(job, result), "mtp": _mtp(result),
        })  # fmt: skip

    @staticmethod
    async def _next(request, job: Job) -> tuple[str, Any] | None:
        """The job's next event; None once its client has gone (its decoding then cancelled,
        within one poll and one token). The client is looked for every poll, also while
        events keep coming (a fast decoder never lets a wait time out)."""
        while True:
            if time.monotonic() >= job.next_poll:
                job.next_poll = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    job.cancel.set()
                    return None
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                job.next_poll = 0.0

    def _envelope(self, rid: str, chat: bool, chunk: bool) -> dict:
        kind = "chat.completion" + (".chunk" if chunk else "") if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_id}

    async def _stream(self, job: Job, first: tuple[str, Any], rid: str, chat: bool,
                      usage: bool) -> AsyncIterator[str]:  # fmt: skip
        def chunk(text: str | None, finish: str | None = None, delta: dict | None = None,
                  **extra) -> str:  # fmt: skip
            if chat:
                delta = delta or ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish,
                          "logprobs": None}  # fmt: skip
            doc = self._envelope(rid, chat, True) | {"choices": [choice]} | extra
            return f"data: {json.dumps(doc)}\n\n"

        try:
            if chat:
                yield chunk(None, delta={"role": "assistant"})
            event = first
            while True:
                kind, value = event if event is not None else await job.events.get()
                event = None
                if kind == "text":
                    # the texts already queued go out as one chunk (a batch's step relays every
                    # row's token at once, a round several of each)
                    while not job.events.empty():
                        event = job.events.get_nowait()
                        if event[0] != "text":
                            break
                        value, event = value + event[1], None
                    yield chunk(value)
                elif kind == "error":
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    yield chunk(None, value.finish_reason, mtp=_mtp(value))
                    if usage:
                        doc = self._envelope(rid, chat, True) | {
                            "choices": [],
                            "usage": _usage(job, value),
                        }
                        yield f"data: {json.dumps(doc)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): stop decoding for it
            job.cancel.set()


def _usage(job: Job, result: GenerateResult) -> dict:
    n = len(result.tokens)
    return {"prompt_tokens": len(job.ids), "completion_tokens": n,
            "total_tokens": len(job.ids) + n,
            "prompt_tokens_details": {"cached_tokens": result.stats.prompt_cached}}  # fmt: skip


def _prompt_cache(cache: PromptCache | None) -> dict | None:
    """The prompt cache as /health shows it (None where it is off)."""
    if cache is None:
        return None
    s = cache.stats
    return {"max_bytes": cache.max_bytes, "bytes": cache.bytes, "entries": len(cache.entries),
            "lookups": s.lookups, "hits": s.hits, "tokens_reused": s.tokens_reused,
            "evicted": s.evicted}  # fmt: skip


def _mtp(result: GenerateResult) -> dict:
    """The MTP statistics of one response (the ``mtp`` field, beside OpenAI's own)."""
    r = result.stats.mtp
    return {
        "engaged": result.mtp_engaged, "draft_kind": result.draft_kind,
        "block_size": result.block_size, "gate_reason": result.gate_reason,
        "acceptance_rate": r.acceptance_rate if r else None,
        "tokens_per_verify": r.tokens_per_verify if r else None,
        "rounds": r.rounds if r else 0,
        "rounds_by_block": {str(b): n for b, n in sorted(r.rounds_by_block.items())} if r else {},
        "generation_tps": result.stats.generation_tps,
    }  # fmt: skip


def check_port(host: str, port: int) -> None:
    """Refuse a host and port this process cannot listen on, before anything is loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"cannot resolve --host {host!r}: {e.strerror}") from e
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ServeError(
                f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or stop "
                "what holds it"
            ) from e


def serve(loaded: Loaded, model_id: str, *, host: str = "127.0.0.1", port: int = 8080,
          block_size: int | None = None, force_mtp: bool = False, default_max_tokens: int = 256,
          note: Callable[[str], None] = lambda msg: None,
          prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
          max_batch: int = 1, prompts_inline: bool = False) -> int | None:  # fmt: skip
    """Serve ``loaded`` until Ctrl-C, SIGTERM or the HTTP server stops. Returns the signal
    that stopped it (None otherwise), once the decoding request has ended with a last event,
    the queued ones got a 503 and the HTTP side closed (within ``STOP_BOUND_S``)."""
    import uvicorn

    check_port(host, port)
    decoder = Decoder(loaded, block_size, force_mtp, note, prompt_cache_bytes, max_batch,
                      prompts_inline)  # fmt: skip
    app = Server(decoder, model_id, default_max_tokens).app()
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="off",
        timeout_graceful_shutdown=max(int(STOP_BOUND_S) - 1, 1),
    ))  # fmt: skip
    http = threading.Thread(target=server.run, name="mtp-serve-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.02)
    if not server.started:
        raise ServeError(f"the HTTP server could not start on {host}:{port}")
    note(f"serving {model_id} on http://{host}:{port}/v1 (OpenAI-compatible; GET /health)")
    stopped_by: list[int] = []

    def on_signal(signum, frame) -> None:
        stopped_by.append(signum)
        decoder.stop()

    handled = (signal.SIGINT, signal.SIGTERM)
    on_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in handled} if on_main else {}
    try:
        decoder.run(keep_going=http.is_alive)
    finally:
        if stopped_by:
            note("stopping")
        decoder.refuse_queued()
        decoder.release()
        deadline = time.monotonic() + STOP_BOUND_S
        server.should_exit = True
        http.join(timeout=max(deadline - time.monotonic(), 0.1))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return stopped_by[0] if stopped_by else None
