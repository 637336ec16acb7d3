"""An OpenAI-compatible HTTP server over the continuous-batching `Engine`, on FastAPI + uvicorn (what
`transformers serve` is built on: `transformers/cli/serving/server.py`).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both `stream=true` as server-sent events, ending
with `data: [DONE]`, or one JSON body), `GET /v1/models`, `GET /health`, `GET /metrics` (tokens/s, acceptance per
level, queue length, KV blocks in use, request counts; JSON).

Request fields: `model` (must be the served name), `prompt` (a string, a list of token ids, or a list of one of
either) / `messages` (roles system/user/assistant/developer/tool, content a string or a list of text parts),
`max_tokens` (`max_completion_tokens` for chat; default 256, at most the server's `--max-tokens`), `temperature`
(absent or 0: greedy; > 0: sampling), `top_p`, `stop` (a string or up to 4), `stream`, `stream_options.
include_usage`, `n` (1 only), `seed` (refused: one sampling generator serves a batch); hispec extensions via the
openai client's `extra_body`: `strategy` (`ar`, `self-spec`, `hispec`, `auto`, a hierarchy spec), `gammas`,
`top_k`, `verification`. Anything malformed gets a 4xx with an OpenAI-style error body naming the problem.

A client that disconnects cancels its request: the engine drops the row at its next step and frees its blocks.
SIGTERM: the server stops taking requests (503), lets those in flight finish for `drain_timeout` seconds, then ends
the rest with an error event (streams) or a 503 (others), and exits; nothing hangs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import Engine, EngineError
from .engine import Request as GenRequest

ROLES = {"system", "user", "assistant", "developer", "tool"}
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "response_format",
               "logit_bias")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_


def _error(status: int, message: str, param=None, code=None, type_="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class _Text:
    """Incremental detokenisation with stop strings: text is released only when it is final (no partial UTF-8
    character, no possible start of a stop string), and cut before a stop string (OpenAI semantics)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        if not final:
            if text.endswith("\ufffd"):
                text = text[:-1]
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(self.sent, len(text) - hold)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out

    def full(self) -> str:
        """The whole completion text, cut before the first stop string."""
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
        return text[:cut]


def build_app(engine: Engine, model_name: str, *, max_tokens: int = 4096, default_max_tokens: int = 256,
              drain_timeout: float = 30.0) -> FastAPI:
    tokenizer = engine.model.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 0.0)

    app = FastAPI(title="hispec-serve", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.get("/health")
    async def health():
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "hispec"}]}

    @app.get("/metrics")
    async def metrics():
        return engine.metrics()

    # ------------------------------------------------------------------ parsing
    async def _body(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise BadRequest("'model' is required", param="model")
        if model != model_name:
            raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", status=404,
                             param="model", code="model_not_found")
        for k in UNSUPPORTED:
            if body.get(k) not in (None, False, 0, [], {}):
                raise BadRequest(f"'{k}' is not supported by hispec-serve", param=k)
        if body.get("n", 1) != 1:
            raise BadRequest("n > 1 is not supported: send one request per completion", param="n")
        if body.get("seed") is not None:
            raise BadRequest("'seed' is not supported: sampling rows of a batch share one generator", param="seed")
        return body

    def _settings(body: dict, prompt: list[int], max_key: str) -> GenRequest:
        mt = body.get(max_key, body.get("max_tokens", default_max_tokens))
        if mt is None:
            mt = default_max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise BadRequest(f"'{max_key}' must be an integer >= 1, got {mt!r}", param=max_key)
        if mt > max_tokens:
            raise BadRequest(f"'{max_key}' is {mt}; this server allows at most {max_tokens}", param=max_key)
        temperature = body.get("temperature")
        if temperature is not None and (not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2):
            raise BadRequest(f"'temperature' must be a number in [0, 2], got {temperature!r}", param="temperature")
        do_sample = bool(temperature)
        top_p = body.get("top_p")
        if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
            raise BadRequest(f"'top_p' must be in (0, 1], got {top_p!r}", param="top_p")
        top_k = body.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise BadRequest(f"'top_k' must be an integer >= 1, got {top_k!r}", param="top_k")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        strategy = body.get("strategy")
        if strategy is not None and not isinstance(strategy, str):
            raise BadRequest("'strategy' must be a string", param="strategy")
        gammas = body.get("gammas")
        if gammas is not None and (not isinstance(gammas, list) or not all(isinstance(g, int) for g in gammas)):
            raise BadRequest("'gammas' must be a list of integers", param="gammas")
        return GenRequest(prompt, max_new_tokens=mt, strategy=strategy, gammas=gammas, do_sample=do_sample,
                          temperature=float(temperature or 1.0), top_k=top_k if do_sample else None,
                          top_p=float(top_p) if do_sample and top_p is not None else None, stop=stop or None,
                          verification=body.get("verification"))

    def _completion_prompt(body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise BadRequest("'prompt' is empty", param="prompt")
            return tokenizer.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1:
            raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
        raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")

    def _chat_prompt(body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise BadRequest(f"messages[{i}] must be an object with a role in {sorted(ROLES)}",
                                 param=f"messages[{i}]")
            c = m.get("content")
            if isinstance(c, list):
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in c):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                     param=f"messages[{i}].content")
                c = "".join(part["text"] for part in c)
            if not isinstance(c, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param=f"messages[{i}].content")
            clean.append({"role": m["role"], "content": c})
        try:
            return list(tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise BadRequest(f"the chat template rejected the messages: {e}", param="messages") from None

    # ------------------------------------------------------------------ generation
    def _submit(req: GenRequest, loop, queue: asyncio.Queue):
        def on_update(h, new, finished):
            loop.call_soon_threadsafe(queue.put_nowait, (list(new), finished))

        try:
            return engine.submit(req, on_update=on_update)
        except EngineError as e:
            msg = str(e)
            if "shutting down" in msg:
                raise BadRequest(msg, status=503, type_="server_error") from None
            if "queue is full" in msg:
                raise BadRequest(msg, status=429, type_="rate_limit_error") from None
            raise BadRequest(msg) from None

    async def _generate(request: Request, body: dict, prompt: list[int], chat: bool):
        req = _settings(body, prompt, "max_completion_tokens" if chat else "max_tokens")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        h = _submit(req, loop, queue)
        text = _Text(tokenizer, req.stop or [])
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            return {"prompt_tokens": len(prompt), "completion_tokens": len(h.tokens),
                    "total_tokens": len(prompt) + len(h.tokens)}

        def finish_reason():
            return "stop" if text.stopped else h.finish_reason

        async def next_update():
            """The next (tokens, finished) from the engine; cancels the request if the client went away."""
            while True:
                try:
                    return await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(h.id)
                        raise asyncio.CancelledError from None

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(delta_text, reason):
                if chat:
                    delta = {"content": delta_text} if delta_text or reason is None else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
                else:
                    choice = {"index": 0, "text": delta_text, "finish_reason": reason, "logprobs": None}
                return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": int(time.time()),
                        "model": model_name, "choices": [choice]}

            async def events():
                try:
                    if chat:
                        first = chunk("", None)
                        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                        yield f"data: {json.dumps(first)}\n\n"
                    done = False
                    while not done:
                        new, done = await next_update()
                        if h.finish_reason == "error":
                            err = {"error": {"message": h.error or "generation failed", "type": "server_error",
                                             "param": None, "code": None}}
                            yield f"data: {json.dumps(err)}\n\n"
                            break
                        piece = text.push(new, done)
                        if text.stopped and not done:
                            engine.cancel(h.id)  # the text hit a stop string the tokens had not completed yet
                            done = True
                        if piece or done:
                            yield f"data: {json.dumps(chunk(piece, finish_reason() if done else None))}\n\n"
                    if include_usage:
                        last = chunk("", None)
                        last["choices"], last["usage"] = [], usage()
                        yield f"data: {json.dumps(last)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not h.finished:
                        engine.cancel(h.id)  # the client went away mid-stream (or the server is stopping)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            done = False
            while not done:
                new, done = await next_update()
                text.push(new, done)
                if text.stopped and not done:
                    engine.cancel(h.id)
                    done = True
        except asyncio.CancelledError:
            engine.cancel(h.id)
            raise
        if h.finish_reason == "error":
            return _error(503, h.error or "generation failed", type_="server_error")
        out = text.full()
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish_reason(),
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": out, "finish_reason": finish_reason(), "logprobs": None}
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice],
                "usage": usage(), "hispec": {"token_ids": list(h.tokens)}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        return await _generate(request, body, _completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        return await _generate(request, body, _chat_prompt(body), chat=True)

    return app


def serve(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, max_tokens: int = 4096,
          default_max_tokens: int = 256, drain_timeout: float = 30.0, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM (see the module docstring for what a shutdown does)."""
    import uvicorn

    app = build_app(engine, model_name, max_tokens=max_tokens, default_max_tokens=default_max_tokens,
                    drain_timeout=drain_timeout)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # stop taking requests at once; those in flight get drain_timeout seconds, then an error
            engine.begin_drain(drain_timeout)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(drain_timeout) + 5)
    _Server(config).run()
