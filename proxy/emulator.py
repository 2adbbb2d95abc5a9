"""``balanceroute emulate``: a test double for a barrier-synchronized data-parallel decode fleet.

One process serves G OpenAI-compatible decode ranks on ports ``port .. port + G - 1`` (one
uvicorn server listening on G sockets; the rank is the local port of the connection), and
optionally P prefill instances on the ports after them. It is not a model server: it emits
placeholder tokens with the timing of the step-cost model of the simulator.

Step loop (all ranks together, like DP decode with a barrier): at the start of a step each rank
admits queued requests into its ``batch`` slots (excess waits in the rank's queue, as
``vllm:num_requests_waiting``); its load is ``L_g = sum(prompt + generated)`` over its active
requests; the step lasts ``(A * max_g L_g + B) / time_scale`` wall seconds; at its end every
active request generates one token. Each step is logged (``GET /emulator/steps``) with the
per-rank loads, so a test can compute imbalance from the engine's own view.

Output length: with ``ignore_eos`` exactly ``max_tokens`` tokens (finish ``length``, as vLLM
reports it); otherwise a seeded draw ``1 + Geometric(1 / mean_output)`` capped at
``max_tokens`` (finish ``stop`` below the cap). Draws come from one
``numpy.random.Generator`` per rank seeded with ``(seed, rank)``, in arrival order.
``max_tokens`` defaults to 256 when absent. Prompt tokens follow :mod:`proxy.tokens`.

Chat requests with ``tools`` and ``tool_choice`` ``"required"`` or a named function answer with
one tool call whose arguments stream one piece per token (finish ``tool_calls``).

A client that disconnects cancels its request: it leaves its rank's queue or batch at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from router_client.simulator import DEFAULT_STEP_COST

from .tokenizer import PromptCounter
from .tokens import body_problem, max_tokens, prompt_tokens

log = logging.getLogger("balanceroute.emulator")

MODEL_NAME = "balanceroute-emulated"
DEFAULT_MAX_TOKENS = 256


@dataclass(eq=False)
class EmuRequest:
    request_id: str
    prompt_tokens: int
    target: int
    max_tokens: int
    generated: int = 0
    finished: str | None = None
    tokens_ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rank:
    index: int
    rng: np.random.Generator
    queue: deque[EmuRequest] = field(default_factory=deque)
    active: list[EmuRequest] = field(default_factory=list)
    finished: int = 0
    cancelled: int = 0
    handoffs: int = 0

    @property
    def load(self) -> int:
        return sum(r.prompt_tokens + r.generated for r in self.active)


@dataclass(frozen=True)
class EmulatorConfig:
    workers: int = 8
    batch: int = 64
    step_cost: tuple[float, float] = DEFAULT_STEP_COST
    time_scale: float = 1.0
    seed: int = 0
    mean_output: float = 128.0
    kv_capacity: int = 1_000_000
    prefill_workers: int = 0
    log_steps: int = 200_000
    max_queued: int | None = None  # waiting requests a rank keeps beyond its batch; 503 past
    # it (SGLang's --max-queued-requests); None: no bound (vLLM)
    start_after: int = 0  # the first step waits until this many requests have come (a
    # benchmark's first wave: its fleet full from step 0, as ``ab --load backlog``'s), or
    # ``start_timeout_s`` of wall time after the first one
    start_timeout_s: float = 30.0
    tokenizer: str | None = None  # count prompts with this tokenizer.json, as an engine does


class Emulator:
    """The fleet: ranks, the barrier step loop and the step log."""

    def __init__(self, config: EmulatorConfig) -> None:
        if config.workers < 1 or config.batch < 1 or not config.time_scale > 0:
            raise ValueError("workers and batch must be >= 1 and time_scale > 0")
        if config.max_queued is not None and config.max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        if config.start_after < 0:
            raise ValueError("start_after must be >= 0")
        self.config = config
        self.ranks = [Rank(g, np.random.default_rng([config.seed, g]))
                      for g in range(config.workers)]
        self.steps: deque[dict[str, Any]] = deque(maxlen=config.log_steps)
        self.step_index = 0
        self.emulated_s = 0.0
        self.prefill_running = [0] * config.prefill_workers
        self.submitted = 0
        self.count: Callable[[dict[str, Any]], int] = (
            PromptCounter.load(config.tokenizer) if config.tokenizer else prompt_tokens)
        self._wake: asyncio.Event | None = None

    # -- requests ---------------------------------------------------------------------------
    def submit(self, rank: int, body: dict[str, Any]) -> EmuRequest:
        maximum = max_tokens(body, DEFAULT_MAX_TOKENS)
        if body.get("ignore_eos"):
            target = maximum
        else:
            draw = 1 + int(self.ranks[rank].rng.geometric(1.0 / self.config.mean_output))
            target = min(maximum, draw)
        request = EmuRequest(f"emu-{uuid.uuid4().hex[:16]}", self.count(body), target,
                             maximum)
        if isinstance(body.get("kv_transfer_params"), dict):
            self.ranks[rank].handoffs += 1
        self.ranks[rank].queue.append(request)
        self.submitted += 1
        if self._wake is not None:
            self._wake.set()
        return request

    def full(self, rank: int) -> bool:
        """Whether ``rank`` refuses a new request: its queue beyond the batch is at
        ``max_queued``."""
        state = self.ranks[rank]
        return (self.config.max_queued is not None and len(state.active) + len(state.queue)
                >= self.config.batch + self.config.max_queued)

    def cancel(self, rank: int, request: EmuRequest) -> None:
        if request.finished is not None:
            return
        request.finished = "cancelled"
        state = self.ranks[rank]
        state.cancelled += 1
        if request in state.active:
            state.active.remove(request)
        else:
            try:
                state.queue.remove(request)
            except ValueError:
                pass

    # -- the barrier step loop --------------------------------------------------------------
    async def run(self) -> None:
        self._wake = asyncio.Event()
        a, b = self.config.step_cost
        loop = asyncio.get_running_loop()
        await self._first_wave()
        while True:
            if not any(rank.queue or rank.active for rank in self.ranks):
                self._wake.clear()
                await self._wake.wait()
            admitted = 0
            for rank in self.ranks:
                while rank.queue and len(rank.active) < self.config.batch:
                    rank.active.append(rank.queue.popleft())
                    admitted += 1
            loads = [rank.load for rank in self.ranks]
            counts = [len(rank.active) for rank in self.ranks]
            if not any(counts):
                continue
            model_dt = a * max(loads) + b
            started = loop.time()
            await asyncio.sleep(model_dt / self.config.time_scale)
            tokens = 0
            for rank in self.ranks:
                still: list[EmuRequest] = []
                for request in rank.active:
                    if request.finished is not None:  # cancelled during the step
                        continue
                    request.generated += 1
                    tokens += 1
                    if request.generated >= request.target:
                        request.finished = ("length" if request.target >= request.max_tokens
                                            else "stop")
                        rank.finished += 1
                    else:
                        still.append(request)
                    request.tokens_ready.set()
                rank.active = still
            self.emulated_s += model_dt
            self.steps.append({
                "step": self.step_index, "dt": model_dt, "loads": loads, "active": counts,
                "waiting": [len(rank.queue) for rank in self.ranks], "tokens": tokens,
                "admitted": admitted,
                "wall": loop.time() - started,
            })
            self.step_index += 1

    async def _first_wave(self) -> None:
        """Hold the first step until ``start_after`` requests have come (cancelled ones
        included), or ``start_timeout_s`` after the first: a load generator's first wave
        reaches the ranks over many steps otherwise (a few hundred requests a second through
        a proxy on a small machine), and a benchmark would measure that intake, not the
        routing."""
        assert self._wake is not None
        wanted = self.config.start_after
        deadline = None
        loop = asyncio.get_running_loop()
        while self.submitted < wanted:
            if self.submitted and deadline is None:
                deadline = loop.time() + self.config.start_timeout_s
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return

    async def prefill(self, instance: int, body: dict[str, Any], port: int) -> dict[str, Any]:
        """A prefill instance: one forward pass over the prompt, then the KV handle."""
        prompt = self.count(body)
        a, b = self.config.step_cost
        self.prefill_running[instance] += 1
        try:
            await asyncio.sleep((a * prompt + b) / self.config.time_scale)
        finally:
            self.prefill_running[instance] -= 1
        handle = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": f"emu-prefill-{instance}",
            "remote_block_ids": list(range((prompt + 15) // 16)),
            "remote_host": "127.0.0.1", "remote_port": port,
            "remote_request_id": f"emu-{uuid.uuid4().hex[:16]}",
        }
        return {"prompt_tokens": prompt, "kv_transfer_params": handle}

    def steps_since(self, since: int) -> list[dict[str, Any]]:
        first = self.step_index - len(self.steps)
        return list(self.steps)[max(0, since - first):]


def summarize(steps: list[dict[str, Any]], a_cost: float) -> dict[str, float]:
    """Imbalance and throughput over logged steps (emulated time, from the cost model), and
    ``ab``'s balanced bound: the same steps' tokens had every step cost ``a * mean_g L_g + b``
    instead of ``a * max_g L_g + b`` (``a_cost``: the model's ``a``). Throughput over the bound
    is the routing's share of what perfect balance of the same work would give, which does not
    depend on how much work the fleet held; throughput alone does."""
    busy = [s for s in steps if any(s["active"])]
    if not busy:
        return {"steps": 0, "tokens": 0, "emulated_s": 0.0, "tok_s": 0.0,
                "balanced_bound_tok_s": 0.0,
                "imbalance_maxmin_mean": 0.0, "imbalance_total_mean": 0.0}
    loads = np.asarray([s["loads"] for s in busy], dtype=np.float64)
    top = loads.max(axis=1)
    excess = loads.shape[1] * top - loads.sum(axis=1)  # what the barrier idles, per step
    tokens = int(sum(s["tokens"] for s in busy))
    emulated = float(sum(s["dt"] for s in busy))
    balanced = emulated - a_cost * float(excess.sum()) / loads.shape[1]
    return {
        "steps": len(busy), "tokens": tokens, "emulated_s": emulated,
        "tok_s": tokens / emulated if emulated else 0.0,
        "balanced_bound_tok_s": tokens / balanced if balanced > 0 else 0.0,
        "imbalance_maxmin_mean": float((top - loads.min(axis=1)).mean()),
        "imbalance_total_mean": float(excess.mean()),
    }


# -- HTTP -------------------------------------------------------------------------------------
def _chunk(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


TOOL_CHOICES = ("none", "auto", "required")


def _tools_problem(body: dict[str, Any]) -> str | None:
    """What is wrong with ``tools`` / ``tool_choice``, naming the field (None: nothing)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return "'tools' must be a list of tools"
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("function") or {}, dict):
                return f"'tools[{i}]' must be an object whose 'function' is an object"
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if not isinstance(choice.get("function") or {}, dict):
            return "'tool_choice.function' must be an object"
    elif choice is not None and choice not in TOOL_CHOICES:
        return "'tool_choice' must be 'none', 'auto', 'required' or an object naming a function"
    return None


def _min_tokens_problem(body: dict[str, Any]) -> str | None:
    """vLLM's check: ``min_tokens`` at most the output cap."""
    least, most = body.get("min_tokens"), max_tokens(body, DEFAULT_MAX_TOKENS)
    if isinstance(least, int) and not isinstance(least, bool) and least > most:
        return f"min_tokens must be less than or equal to max_tokens={most}, got {least}"
    return None


def _tool_call(body: dict[str, Any]) -> str | None:
    tools = body.get("tools")
    if not tools:
        return None
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return str((choice.get("function") or {}).get("name") or "tool")
    if choice == "required":
        first = tools[0] if isinstance(tools[0], dict) else {}
        return str((first.get("function") or {}).get("name") or "tool")
    return None


class _Responder:
    """Shapes one request's output as completions or chat chunks."""

    def __init__(self, body: dict[str, Any], chat: bool, request: EmuRequest) -> None:
        self.chat = chat
        self.request = request
        self.tool = _tool_call(body) if chat else None
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + request.request_id
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.model = body.get("model") or MODEL_NAME

    def piece(self, n: int) -> str:
        if self.tool:
            if n == 1:
                return '{"value": "'
            return '"}' if n == self.request.target else "x"
        return " tok"

    def delta(self, n: int) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": self.piece(n), "logprobs": None, "finish_reason": None}
        if self.tool:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": self.piece(n)}}
            if n == 1:
                call.update(id=f"call_{self.request.request_id}", type="function")
                call["function"]["name"] = self.tool
            return {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}
        return {"index": 0, "delta": {"content": self.piece(n)}, "finish_reason": None}

    def finish_reason(self) -> str:
        return "tool_calls" if self.tool else str(self.request.finished)

    def usage(self) -> dict[str, int]:
        r = self.request
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.generated,
                "total_tokens": r.prompt_tokens + r.generated}

    def frame(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.piece(n) for n in range(1, self.request.generated + 1))
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": None if self.tool else text}
            if self.tool:
                message["tool_calls"] = [{
                    "id": f"call_{self.request.request_id}", "type": "function",
                    "function": {"name": self.tool, "arguments": text}}]
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "finish_reason": self.finish_reason()}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": self.finish_reason()}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}


def _bad_request(message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                   "code": 400}}, status_code=400)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(emulator: Emulator, base_port: int) -> Starlette:
    G = emulator.config.workers

    def rank_of(request: Request) -> int:
        server = request.scope.get("server")
        port = server[1] if server else base_port
        return int(port) - base_port

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = orjson.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _bad_request(str(exc))
        problem = (body_problem(body, chat) or (_tools_problem(body) if chat else None)
                   or _min_tokens_problem(body))
        if problem is not None:  # as an engine would, before anything runs
            return _bad_request(problem)
        rank = rank_of(request)
        if rank >= G:
            instance = rank - G
            answer = await emulator.prefill(instance, body, base_port + rank)
            fake = EmuRequest("prefill", answer["prompt_tokens"], 1, 1, 1, "length")
            responder = _Responder(body, chat, fake)
            out = responder.whole()
            out["kv_transfer_params"] = answer["kv_transfer_params"]
            return JSONResponse(out)
        if emulator.full(rank):  # as SGLang's --max-queued-requests: busy, nothing ran
            return JSONResponse({"object": "error", "message": "The request queue is full.",
                                 "type": "ServiceUnavailable", "code": 503}, status_code=503)
        emu_request = emulator.submit(rank, body)
        responder = _Responder(body, chat, emu_request)
        if not body.get("stream"):
            waiter = asyncio.ensure_future(_wait_done(emu_request))
            gone = asyncio.ensure_future(wait_disconnect(request))
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, gone):
                task.cancel()
            if emu_request.finished is None:
                emulator.cancel(rank, emu_request)
                return Response(status_code=499)
            return Response(orjson.dumps(responder.whole()), media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(emulator, rank, responder, include_usage),
                                 media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0,
             "owned_by": "balanceroute-emulator"}]})

    async def metrics(request: Request) -> Response:
        rank = rank_of(request)
        labels = f'model_name="{MODEL_NAME}",engine="{rank}"'
        if rank >= G:
            running, waiting, load = emulator.prefill_running[rank - G], 0, 0
        else:
            state = emulator.ranks[rank]
            running, waiting, load = len(state.active), len(state.queue), state.load
        usage = load / emulator.config.kv_capacity
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage:.6f}",
            "# TYPE balanceroute_emulator_kv_tokens gauge",
            f"balanceroute_emulator_kv_tokens{{{labels}}} {load}",
            "# TYPE balanceroute_emulator_steps_total counter",
            f"balanceroute_emulator_steps_total {emulator.step_index}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n",
                                 media_type="text/plain; version=0.0.4")

    async def steps(request: Request) -> Response:
        since = int(request.query_params.get("since", "0"))
        a, b = emulator.config.step_cost
        return Response(orjson.dumps({
            "workers": G, "batch": emulator.config.batch, "step_cost": [a, b],
            "time_scale": emulator.config.time_scale, "next": emulator.step_index,
            "steps": emulator.steps_since(since)}), media_type="application/json")

    async def stats(request: Request) -> Response:
        since = int(request.query_params.get("since", "0"))
        ranks = [{"rank": r.index, "active": len(r.active), "waiting": len(r.queue),
                  "load": r.load, "finished": r.finished, "cancelled": r.cancelled,
                  "handoffs": r.handoffs} for r in emulator.ranks]
        return JSONResponse({"next": emulator.step_index, "ranks": ranks,
                             **summarize(emulator.steps_since(since),
                                        emulator.config.step_cost[0])})

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/emulator/steps", steps, methods=["GET"]),
        Route("/emulator/stats", stats, methods=["GET"]),
    ]
    return Starlette(routes=routes)


async def _wait_done(request: EmuRequest) -> None:
    while request.finished is None:
        request.tokens_ready.clear()
        await request.tokens_ready.wait()


async def _stream(emulator: Emulator, rank: int, responder: _Responder,
                  include_usage: bool):
    request = responder.request
    sent = 0
    try:
        if responder.chat:
            yield _chunk(responder.frame([{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                           "finish_reason": None}]))
        while True:
            while sent < request.generated:
                sent += 1
                choice = responder.delta(sent)
                if sent == request.generated and request.finished is not None:
                    choice["finish_reason"] = responder.finish_reason()
                yield _chunk(responder.frame([choice]))
            if request.finished is not None:
                break
            request.tokens_ready.clear()
            await request.tokens_ready.wait()
        if include_usage:
            yield _chunk(responder.frame([], usage=responder.usage()))
        yield b"data: [DONE]\n\n"
    finally:
        if request.finished is None:
            emulator.cancel(rank, request)


def bind_sockets(host: str, port: int, count: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening sockets on ``port`` .. ``port + count - 1`` (an :class:`OSError` naming the
    port that cannot be bound; those bound before it are closed)."""
    sockets: list[socket.socket] = []
    for offset in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port + offset))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            for bound in sockets:
                bound.close()
            raise OSError(exc.errno, f"cannot listen on {host}:{port + offset}: "
                          f"{exc.strerror or exc}") from None
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


async def serve(config: EmulatorConfig, host: str = "127.0.0.1", port: int = 9000,
                listening: Callable[[], None] | None = None) -> None:
    """Serve the ranks; ``listening`` is called once their ports are bound (the command sets
    up its logging there: a run that cannot bind leaves the process's logging alone)."""
    emulator = Emulator(config)
    app = build_app(emulator, port)
    sockets = bind_sockets(host, port, config.workers + config.prefill_workers)
    if listening is not None:
        listening()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_keep_alive=30))
    stepper = asyncio.ensure_future(emulator.run())
    log.info("emulating %d decode ranks on %s:%d-%d (%d prefill after them)",
             config.workers, host, port, port + config.workers - 1, config.prefill_workers)
    try:
        await server.serve(sockets=sockets)
    finally:
        stepper.cancel()
