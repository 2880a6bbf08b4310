"""``mtp serve``: the real server on a free port, spoken to by the ``openai`` client and httpx.

The expected texts come from ``mtp generate --json`` on the same example (at temperature 0,
MTP and classic give the same tokens), not from the server itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mtpcli.cli import run
from mtpcli.generation import StopText

PROMPTS = ["def parse_args(argv):", "import os\n", "class Parser:", "for line in"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp, options=("--draft-kind", "mtp")) -> tuple[subprocess.Popen, str]:
    """The built-in example served (by default with MTP forced: every request runs the MTP
    engine), up."""
    port = _free_port()
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - the process holds it
    env = dict(os.environ, MTP_CACHE_DIR=str(tmp / "cache"))
    argv = [sys.executable, "-m", "mtpcli", "serve", *options, "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, (tmp / "serve.log").read_text()
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the server did not come up: " + (tmp / "serve.log").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    proc, base = _start(tmp)
    yield base
    proc.terminate()  # SIGTERM: stops cleanly, exit 0
    code = proc.wait(timeout=20)
    assert code == 0 and "stopping" in (tmp / "serve.log").read_text()


@pytest.fixture(scope="module")
def reference():
    """``mtp generate --json`` texts, by (prompt, chat template used, tokens)."""
    import contextlib
    import io

    memo: dict = {}

    def get(prompt: str, chat: bool, n: int, seed: int | None = None) -> dict:
        """``seed``: sampled at temperature 0.8 with that seed."""
        key = (prompt, chat, n, seed)
        if key not in memo:
            argv = ["generate", "-p", prompt, "-n", str(n), "--json", "--draft-kind", "none"]
            argv += [] if seed is None else ["--temp", "0.8", "--seed", str(seed)]
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                assert run(argv + ([] if chat else ["--ignore-chat-template"])) == 0
            memo[key] = json.loads(out.getvalue())
        return memo[key]

    return get


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_and_completions_equal_generate(server, reference):
    client = _client(server)
    chat = client.chat.completions.create(
        model="example", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
        temperature=0,
    )  # fmt: skip
    ref = reference(PROMPTS[0], True, 24)
    assert chat.choices[0].message.content == ref["text"]
    assert chat.choices[0].finish_reason == ref["finish_reason"] == "length"
    assert chat.usage.completion_tokens == len(ref["tokens"])
    mtp = chat.model_extra["mtp"]
    assert mtp["engaged"] and mtp["rounds"] > 0 and 0 <= mtp["acceptance_rate"] <= 1
    assert 1 <= mtp["tokens_per_verify"] <= mtp["block_size"]

    text = client.completions.create(model="example", prompt=PROMPTS[1], max_tokens=20)
    assert text.choices[0].text == reference(PROMPTS[1], False, 20)["text"]
    assert [m.id for m in client.models.list().data] == ["example"]


def test_streaming_gives_the_same_text_in_pieces(server, reference):
    client = _client(server)
    stream = client.chat.completions.create(
        model="example", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=24,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed, not sent at the end
    assert "".join(pieces) == reference(PROMPTS[2], True, 24)["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    assert chunks[-1].usage.completion_tokens == 24

    done = list(client.completions.create(model="example", prompt=PROMPTS[3], max_tokens=16,
                                          stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in done) == reference(PROMPTS[3], False, 16)["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(server, reference, stream):
    full = reference(PROMPTS[0], False, 32)["text"]
    stop = full[10:13]  # a string the text is known to hold
    expected = full[: full.find(stop)]
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 32, "stop": [stop, "@@@@"],
            "stream": stream}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    if stream:
        docs = [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: {")]  # fmt: skip
        text = "".join(d["choices"][0]["text"] for d in docs)
        finish = docs[-1]["choices"][0]["finish_reason"]
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert text == expected and finish == "stop"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": "example", "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ({"model": "example", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "example", "prompt": "x " * 5000, "max_tokens": 8}, 400, "prompt"),
        ({"model": "example", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "example", "prompt": "x", "top_k": -1}, 400, "top_k"),
        ({"model": "example", "prompt": "x", "min_p": 2}, 400, "min_p"),
        ({"model": "example", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": "example", "prompt": "x", "stream_options": "yes"}, 400, "stream_options"),
        ({"model": "example", "prompt": "x", "stream": "yes"}, 400, "stream"),
        (b'{"model": "example", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
        ({"model": "example", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "example", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "example", "prompt": ""}, 400, "prompt"),
        ({"model": "example", "messages": []}, 400, "messages"),
        ({"model": "example", "messages": [{"role": "user"}]}, 400, "messages"),
        ({"model": "example", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
        ({"model": "example", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        (
            {
                "model": "example",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            400,
            "response_format",
        ),
        (
            {
                "model": "example",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            400,
            "tools",
        ),
    ],
)
def test_bad_requests_get_a_json_error_and_disturb_nothing(server, reference, body, status,
                                                           param):  # fmt: skip
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else (
        "/v1/completions")  # fmt: skip
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=60, **kw)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["param"] == param
    if "x " * 5000 == (body.get("prompt") if isinstance(body, dict) else None):
        assert error["code"] == "context_length_exceeded"
    ok = httpx.post(f"{server}/v1/completions", timeout=120,
                    json={"model": "example", "prompt": PROMPTS[1], "max_tokens": 8})  # fmt: skip
    assert ok.json()["choices"][0]["text"] == reference(PROMPTS[1], False, 8)["text"]


def _wait_until_cancelled(server: str, before: int, seconds: float) -> None:
    """Until /health counts one more cancelled request and nothing decoding, or fail."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        health = httpx.get(f"{server}/health").json()
        if health["cancelled"] > before and not health["decoding"]:
            return
        time.sleep(0.2)
    pytest.fail(f"the abandoned request kept decoding: {health}")


def test_a_client_that_leaves_mid_stream_stops_its_decoding(server, reference):
    before = httpx.get(f"{server}/health").json()["cancelled"]
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert got and got[0].startswith("data: {")
    # the connection is closed with ~3000 tokens to go; the decoder notices and moves on
    _wait_until_cancelled(server, before, 60)
    ok = httpx.post(f"{server}/v1/completions", timeout=120,
                    json={"model": "example", "prompt": PROMPTS[3], "max_tokens": 12})  # fmt: skip
    assert ok.json()["choices"][0]["text"] == reference(PROMPTS[3], False, 12)["text"]


def test_default_values_of_unsupported_features_are_accepted(server, reference):
    body = {"model": "example", "prompt": PROMPTS[1], "max_tokens": 8, "logprobs": None,
            "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1,
            "logit_bias": {}}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(
        PROMPTS[1], False, 8)["text"]  # fmt: skip


def test_twenty_concurrent_requests_are_all_answered_exactly(server, reference):
    cases = [(PROMPTS[i % 4], i % 2 == 0, 10 + i % 3 * 4) for i in range(20)]

    async def ask(client: httpx.AsyncClient, prompt: str, chat: bool, n: int) -> str:
        if chat:
            body = {"model": "example", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": n}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=body)
            return r.json()["choices"][0]["message"]["content"]
        body = {"model": "example", "prompt": prompt, "max_tokens": n}
        r = await client.post("/v1/completions", json=body)
        return r.json()["choices"][0]["text"]

    async def main() -> tuple[list[str], int]:
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            tasks = [asyncio.create_task(ask(client, *c)) for c in cases]
            await asyncio.sleep(0.3)
            queued = (await client.get("/health")).json()["queued"]
            return await asyncio.gather(*tasks), queued

    served_before = httpx.get(f"{server}/health").json()["served"]
    texts, queued = asyncio.run(main())
    assert texts == [reference(*c)["text"] for c in cases]
    assert queued > 0  # they waited their turn rather than decoding at once
    assert httpx.get(f"{server}/health").json()["served"] == served_before + 20


def test_stop_text_holds_back_what_could_begin_a_stop():
    s = StopText(["END", "\n\n"])
    shown = [s.feed(p) for p in ["ab", "cE", "N", "x", "y\n", "\n", "tail"]]
    assert shown == ["ab", "c", "", "ENx", "y", "", ""]  # the first "\n\n" ends the text
    assert s.hit and s.text == "abcENxy" and s.flush() == ""
    t = StopText(["END"])
    assert t.feed("xxE") == "xx" and not t.hit and t.flush() == "E"  # no stop: all of it


def test_cancel_and_finish_reasons(load):
    from mtpcli.generation import generate

    pair = load()
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 5

    r = generate(pair, [1, 2, 3], max_tokens=40, force_mtp=True, cancelled=cancelled)
    assert r.finish_reason == "cancelled" and len(r.tokens) == 5
    full = generate(pair, [1, 2, 3], max_tokens=12, force_mtp=True)
    assert full.finish_reason == "length" and len(full.tokens) == 12
    assert r.tokens == generate(pair, [1, 2, 3], max_tokens=5).tokens


def test_serve_refuses_a_port_in_use(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code = run(["serve", "--port", str(s.getsockname()[1])])
    assert code == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_top_k_and_min_p_are_honoured(server, reference):
    """top_k 1 (or min_p 1) at temperature 1 leaves one token to sample: every seed gives the
    greedy text."""
    want = reference(PROMPTS[2], False, 12)["text"]
    for seed in range(4):
        for keep in ({"top_k": 1}, {"min_p": 1.0}):
            body = {"model": "example", "prompt": PROMPTS[2], "max_tokens": 12,
                    "temperature": 1.0, "seed": seed} | keep  # fmt: skip
            r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
            assert r.json()["choices"][0]["text"] == want, (seed, keep)


def test_a_client_that_gives_up_on_a_plain_request_frees_the_decoder(server, reference):
    before = httpx.get(f"{server}/health").json()["cancelled"]
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    _wait_until_cancelled(server, before, 30)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)],
                         ids=["sigterm", "sigint"])  # fmt: skip
def test_a_signal_ends_streams_answers_the_queue_and_exits(tmp_path, sig, code):
    """A stream in flight ends with a last event (finish_reason, then [DONE]); a request still
    queued gets a 503; the process exits with the signal's code within the bound."""
    proc, base = _start(tmp_path)
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True}
    queued = {}

    def later():
        short = {"model": "example", "prompt": PROMPTS[1], "max_tokens": 8}
        r = httpx.post(f"{base}/v1/completions", timeout=60, json=short)
        queued["status"], queued["body"] = r.status_code, r.json()

    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            waiting = threading.Thread(target=later)
            waiting.start()
            while httpx.get(f"{base}/health").json()["queued"] == 0:
                time.sleep(0.05)
            t0 = time.time()
            proc.send_signal(sig)
            rest = [line for line in lines if line]
        waiting.join(timeout=30)
        assert proc.wait(timeout=30) == code
        assert time.time() - t0 < 5 + 1  # serve.STOP_BOUND_S, and the test's own overhead
    finally:
        proc.kill()
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "cancelled"
    assert queued["status"] == 503 and queued["body"]["error"]["code"] == "server_shutting_down"


def test_a_shared_system_prompt_is_processed_once_and_answers_stay_exact(server):
    """The second request with the same long system prompt resumes from the snapshot where
    the system message ends; both answers are the cold ``mtp generate`` answers."""
    import contextlib
    import io

    system = " ".join(f"Rule {i}: keep the parser small and its errors plain." for i in range(25))
    client = _client(server)
    health = httpx.get(f"{server}/health").json()["prompt_cache"]
    for i, prompt in enumerate(PROMPTS[:2]):
        out = io.StringIO()
        argv = ["generate", "-p", prompt, "--system-prompt", system, "-n", "16", "--json",
                "--draft-kind", "none"]  # fmt: skip
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert run(argv) == 0
        ref = json.loads(out.getvalue())
        assert 512 < ref["stats"]["prompt_tokens"] < 1024  # the system message ends past 512
        r = client.chat.completions.create(
            model="example", max_tokens=16, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt}],
        )  # fmt: skip
        assert r.choices[0].message.content == ref["text"]
        assert r.usage.prompt_tokens == ref["stats"]["prompt_tokens"]
        cached = r.usage.prompt_tokens_details.cached_tokens
        # the second: all but the user's turn (the template's few tokens and the prompt)
        assert cached == 0 if i == 0 else 512 < cached < ref["stats"]["prompt_tokens"] - 5
    after = httpx.get(f"{server}/health").json()["prompt_cache"]
    assert after["hits"] == health["hits"] + 1 and after["tokens_reused"] > 512
    assert 0 < after["bytes"] <= after["max_bytes"] == 2 << 30


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """The example served with up to 4 requests decoding together."""
    tmp = tmp_path_factory.mktemp("serve-batched")
    proc, base = _start(tmp, ("--max-batch", "4"))
    yield base
    proc.terminate()
    assert proc.wait(timeout=20) == 0


def test_requests_decoding_together_are_answered_exactly(batched, reference):
    """Twelve requests at once through a batch of 4 (joining as others leave, different
    lengths, chat and completions, one with a stop string): each text is ``mtp generate``'s."""
    _together(batched, reference)


def test_requests_in_mtp_rounds_together_are_answered_exactly(tmp_path, reference):
    """The same through a batch of 4 in MTP rounds (MTP forced): each text is ``mtp
    generate``'s, and the responses say MTP ran."""
    proc, base = _start(tmp_path, ("--max-batch", "4", "--draft-kind", "mtp"))
    try:
        how = httpx.get(f"{base}/health").json()["concurrency"]
        _together(base, reference, int(re.search(r"MTP rounds of (\d+)", how)[1]) + 1)
        body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 12}
        r = httpx.post(f"{base}/v1/completions", timeout=120, json=body)
        assert r.json()["choices"][0]["text"] == reference(PROMPTS[0], False, 12)["text"]
        mtp = r.json()["mtp"]
        assert mtp["engaged"] and mtp["rounds"] > 0 and mtp["acceptance_rate"] > 0
        assert "MTP rounds" in httpx.get(f"{base}/health").json()["concurrency"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def _together(batched: str, reference, per_step: int = 1) -> None:
    """``per_step``: the most tokens a row gets from one step (an MTP round's block + 1)."""
    cases = [(PROMPTS[i % 4], i % 2 == 0, 6 + i % 5 * 7) for i in range(12)]
    stop = reference(PROMPTS[1], False, 20)["text"][5:9]

    async def ask(client, prompt, chat, n, stop=None, seed=None):
        if chat:
            body = {"model": "example", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": n}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=body)
            return r.json()["choices"][0]["message"]["content"]
        body = {"model": "example", "prompt": prompt, "max_tokens": n} | (
            {"stop": stop} if stop else {}) | (
            {} if seed is None else {"temperature": 0.8, "seed": seed})  # fmt: skip
        r = await client.post("/v1/completions", json=body)
        return r.json()["choices"][0]["text"]

    async def streamed(client, prompt, n):
        # the pieces queued while the stream was sending go out merged: their text is the same
        body = {"model": "example", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n, "stream": True}  # fmt: skip
        pieces = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    doc = json.loads(line[6:])
                    pieces += [c["delta"].get("content") or "" for c in doc["choices"]]
        return "".join(pieces)

    async def main():
        async with httpx.AsyncClient(base_url=batched, timeout=300) as client:
            before = (await client.get("/health")).json()["time"]
            tasks = [asyncio.create_task(ask(client, *c)) for c in cases]
            tasks.append(asyncio.create_task(streamed(client, PROMPTS[2], 30)))
            # a seeded sample joining while others decode (its keys made on the prompt thread)
            tasks.append(asyncio.create_task(ask(client, PROMPTS[3], False, 16, seed=11)))
            tasks.append(asyncio.create_task(ask(client, PROMPTS[1], False, 20, stop)))
            rows = 0
            while not all(t.done() for t in tasks):
                rows = max(rows, (await client.get("/health")).json()["rows"])
                await asyncio.sleep(0.02)
            after = (await client.get("/health")).json()["time"]
            return [t.result() for t in tasks], rows, before, after

    texts, rows, before, after = asyncio.run(main())
    assert texts[:-3] == [reference(*c)["text"] for c in cases]
    assert texts[-3] == reference(PROMPTS[2], True, 30)["text"]
    assert texts[-2] == reference(PROMPTS[3], False, 16, seed=11)["text"]
    assert texts[-1] == reference(PROMPTS[1], False, 20)["text"][:5]
    assert 2 <= rows <= 4  # they decoded together, never more than --max-batch
    # /health's time: 15 prompts processed, and at least the longest request's 34 steps
    assert after["steps"] - before["steps"] >= 34 // per_step
    assert after["prompts_s"] > before["prompts_s"] and after["steps_s"] > before["steps_s"]
    assert after["prompts_beside"] > before["prompts_beside"]  # some joined a decoding batch


def test_bad_input_beside_a_batch_costs_its_rows_nothing(batched, reference):
    """While four requests decode together: a prompt past the context, a malformed body and a
    stream whose client leaves after its first piece each get their answer (a 400, or
    nothing), and the four texts are ``mtp generate``'s."""
    cases = [(PROMPTS[i], False, 30) for i in range(4)]

    async def good(client, prompt, chat, n):
        r = await client.post(
            "/v1/completions", json={"model": "example", "prompt": prompt, "max_tokens": n}
        )
        return r.json()["choices"][0]["text"]  # fmt: skip

    async def leaver(client):
        body = {"model": "example", "prompt": PROMPTS[2], "max_tokens": 500, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    return line.startswith("data: {")

    async def main():
        async with httpx.AsyncClient(base_url=batched, timeout=300) as client:
            tasks = [asyncio.create_task(good(client, *c)) for c in cases]
            tasks.append(asyncio.create_task(leaver(client)))
            await asyncio.sleep(0.2)
            long = await client.post("/v1/completions", json={
                "model": "example", "prompt": "x " * 5000, "max_tokens": 8})  # fmt: skip
            bad = await client.post("/v1/completions", content=b"{not json")
            return await asyncio.gather(*tasks), long, bad

    (*texts, streamed), long, bad = asyncio.run(main())
    assert streamed and long.status_code == 400 and bad.status_code == 400
    assert long.json()["error"]["code"] == "context_length_exceeded"
    assert texts == [reference(*c)["text"] for c in cases]


def test_a_row_whose_client_leaves_frees_its_place(batched, reference):
    before = httpx.get(f"{batched}/health").json()["cancelled"]
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{batched}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
    _wait_until_cancelled(batched, before, 60)
    assert httpx.get(f"{batched}/health").json()["rows"] == 0
    ok = httpx.post(f"{batched}/v1/completions", timeout=120,
                    json={"model": "example", "prompt": PROMPTS[3], "max_tokens": 12})  # fmt: skip
    assert ok.json()["choices"][0]["text"] == reference(PROMPTS[3], False, 12)["text"]


def test_sigterm_ends_every_row_of_a_batch_with_a_last_event(tmp_path):
    proc, base = _start(tmp_path, ("--max-batch", "2"))
    body = {"model": "example", "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True}
    ends: list = []

    def stream():
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            ends.append([line for line in r.iter_lines() if line][-2:])

    try:
        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        while httpx.get(f"{base}/health").json()["rows"] < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert len(ends) == 2
    for last, done in ends:
        assert done == "data: [DONE]"
        assert json.loads(last[len("data: ") :])["choices"][0]["finish_reason"] == "cancelled"
