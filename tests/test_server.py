"""hispec-serve over HTTP with the unchanged `openai` client: outputs equal solo decoding, validation, faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from tiny import tiny_config  # noqa: E402

import hispec  # noqa: E402
from hispec.serve import Engine  # noqa: E402
from hispec.serve.server import build_app  # noqa: E402

NAME = "tiny-hispec"
SERVER_SCRIPT = """
import sys, torch, transformers
sys.path.insert(0, {tests!r})
from test_server import tiny_smol
from hispec.serve import Engine
from hispec.serve.server import serve
torch.set_num_threads(1)
model = tiny_smol({tok!r})
serve(Engine(model, kv_blocks=256), {name!r}, port={port}, drain_timeout={drain}, log_level="warning")
"""


def tiny_smol(tokenizer_dir, seed=0):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer (fast, and real text goes in and out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    cfg = tiny_config("llama")
    cfg.vocab_size = 49152
    cfg.max_position_embeddings = 2048
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    base.eval()
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="linear", tokenizer=tok)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, engine, **kw):
        self.port = _free_port()
        app = build_app(engine, NAME, **kw)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def model(demo_model_dir):
    return tiny_smol(str(demo_model_dir))


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(model, kv_blocks=40, block_size=16, max_batch=8)
    s = _Server(engine, max_tokens=512)
    s.engine = engine
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _solo(model, ids, n, strategy=None):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, strategy=strategy or "ar")
    return out.new_tokens[0]


def _idle(server, timeout=20):
    deadline = time.time() + timeout
    while True:
        m = httpx.get(server.url + "/metrics").json()
        if m["active_requests"] == 0 and m["queue_length"] == 0 and m["kv_blocks_used"] == 0:
            return m
        assert time.time() < deadline, m
        time.sleep(0.05)


def test_completions_and_chat_equal_solo_decoding_streamed_or_not(client, model, server):
    tok = model.tokenizer
    prompt = "The capital of France is"
    for strategy in ("ar", "self-spec", "hispec"):
        ref = tok.decode(_solo(model, tok.encode(prompt), 20, strategy), skip_special_tokens=True)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"strategy": strategy})
        assert r.choices[0].text == ref and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(tok.encode(prompt))
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           extra_body={"strategy": strategy})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref
        assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = tok.decode(_solo(model, ids, 16, "hispec"), skip_special_tokens=True)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                       extra_body={"strategy": "hispec"})
    assert r.choices[0].message.content == ref and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == 16
    _idle(server)


def test_concurrent_clients_each_get_their_solo_output(server, model):
    tok = model.tokenizer
    prompts = ["Once upon a time", "def fib(n):", "Translate to German: good morning", "1, 2, 3,", "Hello"]
    strategies = ["ar", "self-spec", "hispec", "hispec", "self-spec"]
    lengths = [12, 30, 7, 25, 18]

    async def one(c, p, s, n):
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0, stream=True,
                                            extra_body={"strategy": s})
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        tasks = []
        for i, args in enumerate(zip(prompts, strategies, lengths)):
            tasks.append(asyncio.create_task(one(c, *args)))
            await asyncio.sleep(0.02 * i)  # staggered arrivals
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    for p, s, n, out in zip(prompts, strategies, lengths, outs):
        assert out == tok.decode(_solo(model, tok.encode(p), n, s), skip_special_tokens=True)
    _idle(server)


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    m = httpx.get(server.url + "/metrics").json()
    for k in ("tokens_per_second", "acceptance", "queue_length", "kv_blocks_used", "kv_blocks_total"):
        assert k in m


def test_bad_requests_get_4xx_with_a_clear_message(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="at most 512"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[{"content": "no role"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError, match="unknown strategy"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, extra_body={"strategy": "fastest"})
    with pytest.raises(openai.BadRequestError, match="KV blocks"):  # could never fit the 40-block pool
        client.completions.create(model=NAME, prompt="hi " * 300, max_tokens=400)
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    _idle(server)


def test_requests_beyond_the_free_pool_wait_and_complete(server, model):
    # each needs ~17 of the 40 blocks: at most two run at once, the third queues, none is lost
    tok = model.tokenizer

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        rs = await asyncio.gather(*[c.completions.create(model=NAME, prompt=f"Story {i}:", max_tokens=260,
                                                         temperature=0, extra_body={"strategy": "ar"})
                                    for i in range(3)])
        return [r.choices[0].text for r in rs]

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out == tok.decode(_solo(model, tok.encode(f"Story {i}:"), 260), skip_special_tokens=True)
    assert _idle(server)["requests"]["errors"] == 0


def test_client_disconnect_mid_stream_cancels_and_frees_blocks(server):
    before = httpx.get(server.url + "/metrics").json()["requests"]["cancelled"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": NAME, "prompt": "Count:", "max_tokens": 500, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    m = _idle(server)
    assert m["requests"]["cancelled"] == before + 1


def test_stop_strings_cut_the_text(client, model):
    tok = model.tokenizer
    full = client.completions.create(model=NAME, prompt="A B C", max_tokens=30, temperature=0).choices[0].text
    stop = full[8:11]
    assert stop and stop in full
    r = client.completions.create(model=NAME, prompt="A B C", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt="A B C", max_tokens=30, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    del tok


def test_sampling_requests(client):
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=10, temperature=0.7, top_p=0.9,
                                  extra_body={"strategy": "hispec"})
    assert r.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=10, temperature=0.7, seed=1)


@pytest.mark.parametrize("drain", [pytest.param(30.0, marks=pytest.mark.slow), 0.5])
def test_sigterm_with_requests_in_flight_finishes_or_errors_and_exits(demo_model_dir, tmp_path, drain):
    """A real process: SIGTERM while streams run; with time to drain they finish, without they end with an error
    event; new requests are refused; the process exits either way."""
    port = _free_port()
    script = SERVER_SCRIPT.format(tests=os.path.dirname(__file__), tok=str(demo_model_dir), name=NAME, port=port,
                                  drain=drain)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
            time.sleep(0.1)
        results = {}

        def stream(i, n):
            events = results[i] = []
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=60,
                                  json={"model": NAME, "prompt": f"Go {i}", "max_tokens": n, "temperature": 0,
                                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
            except httpx.HTTPError as e:
                events.append(f"transport error {e}")

        lengths = (20, 120, 200) if drain > 10 else (20, 120, 1000)
        threads = [threading.Thread(target=stream, args=(i, n)) for i, n in enumerate(lengths)]
        for t in threads:
            t.start()
        while not all(results.get(i) or False for i in range(3)):  # wait for streams to start
            time.sleep(0.05)
            assert time.time() < deadline + 60
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):  # refused: 503 while draining, or the port is closed
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "late", "max_tokens": 4},
                           timeout=5)
            r.raise_for_status()
        for t in threads:
            t.join(timeout=90)
            assert not t.is_alive(), "a client hangs"
        assert proc.wait(timeout=60) is not None
        for i, events in results.items():
            assert events and events[-1] == "[DONE]", (i, events[-3:])
            last = json.loads(events[-2])
            if drain > 10:
                assert last["choices"][0]["finish_reason"] == "length"
            else:
                assert "error" in last or last["choices"][0]["finish_reason"] == "length"
        if drain < 10:  # the longest one cannot have finished in half a second
            assert "error" in json.loads(results[2][-2])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
