"""The OpenAI-compatible endpoint in front of an engine (fastapi + uvicorn, on 127.0.0.1).

    POST /v1/chat/completions      messages, tools, tool_choice, temperature, top_p, max_tokens /
                                   max_completion_tokens, stop, n=1, stream, logprobs
    POST /v1/completions           a text prompt or token ids; `logprobs` and `return_token_ids`
                                   give log-probs and ids back
    GET  /v1/models
    .../s/{session}/v1/...         the same, attributed to one episode (token-exact capture)

During training each episode gets its own base URL, `http://127.0.0.1:PORT/s/SESSION/v1`, and
every call through it is captured (`actloop.gateway.capture`). Sampling then follows the run's
`rollout` settings (temperature, top_p, max_new_tokens cap): the trainer recomputes log-probs at
`rollout.temperature`, so a client's own temperature would make the sampled log-probs wrong.
`actloop serve` runs the same app without sessions, honouring the client's sampling settings.

A bad request gets a 4xx with OpenAI's error body, {"error": {"message", "type", "param",
"code"}}, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

try:  # the `agents` extra; route annotations below must resolve at module level
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError:  # training without agent code does not need it; create_app says what is missing
    FastAPI = Request = JSONResponse = StreamingResponse = None

from actloop.config import ConfigError
from actloop.gateway.capture import EpisodeCapture, Plan
from actloop.gateway.chat import (ChatFormat, Parsed, RequestError, check_tools, forced_call, to_messages,
                                  tool_choice_tools)
from actloop.rollout.engine import Completion, SamplingParams
from actloop.types import Message


@dataclass
class SamplingPolicy:
    """How request sampling settings become engine SamplingParams.

    fixed=True (training): temperature and top_p are the run's, max_tokens is capped at
    `max_new_tokens`. fixed=False (serve): the client's values, `max_new_tokens` as the default."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    fixed: bool = False


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(f"`{key}` must be a number in [{lo}, {hi}]; got {v!r}", key)
    return float(v)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("`stop` must be a string or a list of up to 4 non-empty strings", "stop")
    return tuple(stop)


class Gateway:
    """Sessions, request checks and the engine, behind the HTTP app (`create_app`)."""

    def __init__(self, engine: Any, fmt: ChatFormat, model_names: tuple[str, ...], max_context: int,
                 sampling: SamplingPolicy):
        self.engine, self.fmt, self.model_names = engine, fmt, tuple(model_names)
        self.max_context, self.sampling = max_context, sampling
        self.sessions: dict[str, EpisodeCapture] = {}
        self.requests = self.errors = 0
        self._server: Any = None
        self.url = ""

    # ---------------------------------------------------------------- sessions
    def open_session(self) -> tuple[str, str]:
        sid = uuid.uuid4().hex[:16]
        self.sessions[sid] = EpisodeCapture(self.fmt)
        return sid, f"{self.url}/s/{sid}/v1"

    def close_session(self, sid: str) -> EpisodeCapture:
        return self.sessions.pop(sid)

    def capture(self, sid: str | None) -> EpisodeCapture | None:
        if sid is None:
            return None
        if sid not in self.sessions:
            raise RequestError(f"unknown session `{sid}` (it ended, or was never opened)", None, 404,
                               "session_not_found", "not_found_error")
        return self.sessions[sid]

    # ---------------------------------------------------------------- checks
    def check_model(self, body: dict[str, Any]) -> str:
        name = body.get("model")
        if not isinstance(name, str):
            raise RequestError("`model` is required", "model")
        if name not in self.model_names:
            raise RequestError(f"The model `{name}` does not exist; this server serves {', '.join(self.model_names)}",
                               "model", 404, "model_not_found", "invalid_request_error")
        return name

    def params(self, body: dict[str, Any], default_max: int | None = None) -> SamplingParams:
        s = self.sampling
        n = body.get("n", 1)
        if n != 1:
            raise RequestError("only n=1 is supported", "n")
        temp = _num(body, "temperature", s.temperature, 0.0, 2.0)
        top_p = _num(body, "top_p", s.top_p, 0.0, 1.0)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_new = body.get(key)
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise RequestError(f"`{key}` must be a positive integer", key)
        limit = max_new or default_max or s.max_new_tokens
        if s.fixed:
            temp, top_p, limit = s.temperature, s.top_p, min(limit, s.max_new_tokens)
        if top_p <= 0:
            raise RequestError("`top_p` must be > 0", "top_p")
        return SamplingParams(max_new_tokens=limit, temperature=max(temp, 1e-6), top_p=top_p, greedy=temp == 0,
                              stop=_stop(body))

    def fit(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        room = self.max_context - len(prompt)
        if room < 1:
            raise RequestError(f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                               f"{len(prompt)} tokens", "messages", 400, "context_length_exceeded")
        if params.max_new_tokens > room:
            params = dataclasses.replace(params, max_new_tokens=room)
        return params

    async def sample(self, prompt: list[int], params: SamplingParams) -> Completion:
        return await asyncio.wrap_future(self.engine.submit(prompt, params))

    # ---------------------------------------------------------------- server
    def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        import uvicorn

        config = uvicorn.Config(create_app(self), host=host, port=port, log_level="warning", lifespan="off",
                                access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        thread = threading.Thread(target=self._server.run, daemon=True, name="actloop-gateway")
        thread.start()
        t0 = time.time()
        while not self._server.started:
            if not thread.is_alive() or time.time() - t0 > 30:
                raise RuntimeError(f"the gateway did not start on {host}:{port}")
            time.sleep(0.01)
        bound = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        self._thread = thread
        return self.url

    def serve_forever(self, port: int, host: str = "127.0.0.1") -> None:
        import uvicorn

        uvicorn.run(create_app(self), host=host, port=port, log_level="info", lifespan="off")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None


# ------------------------------------------------------------------------------- responses


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _tool_calls_json(parsed: Parsed) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.tool_calls]


def _logprobs_content(fmt: ChatFormat, comp: Completion) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(comp.token_ids, comp.logprobs):
        s = fmt.decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return out


async def chat_completion(gw: Gateway, body: dict[str, Any], sid: str | None) -> tuple[dict[str, Any], Parsed]:
    model = gw.check_model(body)
    messages = to_messages(body.get("messages"))
    tools = tool_choice_tools(check_tools(body.get("tools")), body.get("tool_choice"))
    forced, forced_name = forced_call(body.get("tool_choice"), tools)
    params = gw.params(body)
    capture = gw.capture(sid)
    forced_ids: list[int] = []
    if forced:  # the reply opens as a call: the format's call opening, then the model's own tokens
        prefix = gw.fmt.call_prefix(forced_name)
        if capture is not None or prefix is None:
            fmt = gw.fmt.renderer.format_name
            why = ("while training, the forced opening would enter the trajectory as tokens the policy did not sample"
                   if capture is not None else f"the {fmt} chat format cannot force one")
            raise RequestError(f"tool_choice {body.get('tool_choice')!r} cannot be enforced here ({why}); "
                               "send tool_choice auto", "tool_choice")
        forced_ids = gw.fmt.encode(prefix)
    plan: Plan | None = capture.prepare(messages, tools) if capture is not None else None
    prompt = plan.prompt_ids if plan is not None else gw.fmt.prompt_ids(messages, tools) + forced_ids
    params = gw.fit(prompt, params)
    comp = await gw.sample(prompt, params)
    parsed = gw.fmt.parse(forced_ids + list(comp.token_ids))
    content, cut = _cut_at_stop(parsed.content, params.stop)
    calls = _tool_calls_json(parsed) if not cut else []
    finish = "length" if comp.finish_reason == "length" else ("tool_calls" if calls else "stop")
    reply = Message("assistant", content, tool_calls=parsed.tool_calls if calls else ())
    if capture is not None:
        capture.record(plan, comp.token_ids, comp.logprobs, finish, parsed, reply, comp.versions)
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                              "logprobs": {"content": _logprobs_content(gw.fmt, comp)} if body.get("logprobs") else None}
    if body.get("return_token_ids"):
        choice["token_ids"] = list(comp.token_ids)
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": model, "choices": [choice],
           "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(comp.token_ids),
                     "total_tokens": len(prompt) + len(comp.token_ids)}}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = list(prompt)
    return out, parsed


def _chunks(resp: dict[str, Any], include_usage: bool):
    """A finished completion as chat.completion.chunk events (role, content, tool calls, finish)."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    choice, msg = resp["choices"][0], resp["choices"][0]["message"]

    def ev(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                             "logprobs": None}], **extra}) + "\n\n"

    yield ev({"role": "assistant", "content": ""})
    if msg.get("content"):
        yield ev({"content": msg["content"]})
    if msg.get("reasoning_content"):
        yield ev({"reasoning_content": msg["reasoning_content"]})
    for i, tc in enumerate(msg.get("tool_calls") or []):
        yield ev({"tool_calls": [{"index": i, **tc}]})
    yield ev({}, choice["finish_reason"])
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": resp["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


def _prompt_ids(gw: Gateway, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return gw.fmt.encode(prompt)
    vocab = len(gw.fmt.tokenizer)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                  for t in prompt):
        return list(prompt)
    raise RequestError("`prompt` must be a non-empty string or a list of token ids (one prompt)", "prompt")


async def completion(gw: Gateway, body: dict[str, Any], sid: str | None) -> dict[str, Any]:
    model = gw.check_model(body)
    prompt = _prompt_ids(gw, body.get("prompt"))
    params = gw.fit(prompt, gw.params(body, default_max=16))
    capture = gw.capture(sid)
    plan = capture.prepare_ids(prompt) if capture is not None else None
    comp = await gw.sample(prompt, params)
    text, _ = _cut_at_stop(gw.fmt.decode(comp.token_ids), params.stop)
    if capture is not None:
        capture.record(plan, comp.token_ids, comp.logprobs, comp.finish_reason,
                       Parsed(text, None, (), None), Message("assistant", text), comp.versions)
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length" if comp.finish_reason == "length"
                              else "stop", "logprobs": None}
    if body.get("logprobs") is not None:
        choice["logprobs"] = {"tokens": [gw.fmt.decode([t]) for t in comp.token_ids],
                              "token_logprobs": list(comp.logprobs), "top_logprobs": None, "text_offset": None}
    if body.get("return_token_ids"):
        choice["token_ids"] = list(comp.token_ids)
        choice["prompt_token_ids"] = list(prompt)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(comp.token_ids),
                      "total_tokens": len(prompt) + len(comp.token_ids)}}


def create_app(gw: Gateway) -> Any:
    if FastAPI is None:
        raise ConfigError("the gateway needs the `agents` extra: pip install 'actloop[agents]' (fastapi, uvicorn, "
                          "openai)")
    app = FastAPI(title="actloop gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: RequestError) -> JSONResponse:
        gw.errors += 1
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def handle(request: Request, sid: str | None, kind: str):
        gw.requests += 1
        try:
            body = await body_of(request)
            if kind == "chat":
                resp, _ = await chat_completion(gw, body, sid)
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return StreamingResponse(_chunks(resp, usage), media_type="text/event-stream")
                return JSONResponse(resp)
            if body.get("stream"):
                raise RequestError("streaming is supported on /v1/chat/completions only", "stream")
            return JSONResponse(await completion(gw, body, sid))
        except RequestError as e:
            return error(e)
        except Exception as e:  # the engine failed: this request fails, the server goes on
            gw.errors += 1
            return JSONResponse(RequestError(f"internal error: {type(e).__name__}: {e}", None, 500, None,
                                             "server_error").body(), status_code=500)

    def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "actloop"}
                                           for n in gw.model_names]}

    for prefix in ("", "/s/{sid}"):
        app.add_api_route(prefix + "/v1/models", models, methods=["GET"])

    def endpoint(kind: str, session: bool):
        if session:
            async def route(sid: str, request: Request):
                return await handle(request, sid, kind)
        else:
            async def route(request: Request):
                return await handle(request, None, kind)
        return route

    for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
        app.add_api_route(path, endpoint(kind, False), methods=["POST"])
        app.add_api_route("/s/{sid}" + path, endpoint(kind, True), methods=["POST"])

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception):
        return JSONResponse(RequestError(f"no route {request.method} {request.url.path}", None, 404, None,
                                         "not_found_error").body(), status_code=404)

    return app
