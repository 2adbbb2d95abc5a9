"""``balanceroute proxy``: OpenAI-compatible routing proxy in front of DP decode ranks.

One request, end to end (the paper's serving proxy):

1. ``POST /v1/completions`` or ``/v1/chat/completions`` arrives; its prompt token count comes
   from :mod:`proxy.tokens` (exact for token-id prompts, ``chars / 4`` otherwise), or, with
   ``--prefill``, from a prefill probe (``max_tokens`` 1, ``kv_transfer_params`` with
   ``do_remote_decode``, as vLLM's disaggregated-serving proxy sends) on the prefill instance
   with the most free KV budget; the probe's ``kv_transfer_params`` answer is the handle.
2. It joins the Prompt Pool (bounded: 429 when full; TTL: 503 when it expires) and the decode
   dispatcher routes it with ``RouterClient`` (BR-0, BR-H, or a baseline).
3. The request goes whole (plus the KV handle) to the chosen rank, always as a stream with
   ``stream_options.include_usage``; the SSE relay counts tokens in-band
   (``RouterClient.stream``) and either relays the events (streaming client) or folds them
   into one response. The first decode chunk frees the prefill budget.
4. However it ends (finish, cut stream, client disconnect in the pool or mid-stream, rank
   failure), the slot is freed and the dispatcher woken.

A rank that refuses connections before a request started there is marked down and the
request is routed again (a fresh id: the mirrored state never re-admits an id); one that
answers busy (429, 503) is held back for its ``Retry-After`` and the request routed again, up
to as many refusals as ranks (then the last goes to the client). With
``--bypass`` the router counts ``2 * batch`` slots per rank: requests are dispatched as soon
as they arrive and wait in the engine's queue (dispatched but not running, counted as load),
so KV transfer overlaps compute at the cost of routing quality.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from predictor.asgi import BODY_LIMIT, MIN_BODY_LIMIT, BodyLimit, body_budget
from router_client.admission import GUARD_RULES, BalanceRouteParams, GuardRule
from router_client.client import RouterClient, RouterConfig
from router_client.errors import ParameterError
from router_client.http_predictor import HttpPredictor
from router_client.policies import make_policy
from router_client.predictors import Predictor
from router_client.sse import StreamTelemetry
from router_client.traces import key_of_text

from . import BR_POLICIES, LENGTHS_FROM, POLICIES
from .dispatcher import BackgroundPredictor, Dispatcher, MaxTokensPredictor, RankMaskPolicy
from .emulator import wait_disconnect
from .engines import EngineSet, retry_after_s
from .metrics import ProxyMetrics
from .pool import NoRankUp, PendingPool, PoolExpired, PoolFull
from .relay import NATURAL_TOOL_FINISHES, Aggregate, is_usage_only
from .tokenizer import PromptCounter
from .tokens import PromptCalibration, body_problem, calibratable, prompt_tokens

log = logging.getLogger("balanceroute.proxy")

# A client that knows what its requests share (a template, a conversation) names it: the
# prediction service's ExactMatch groups requests by this key (API.md's prompt_key); without
# it, the key is the xxh3_64 hash of the prompt (or messages) JSON.
PROMPT_KEY_HEADER = "x-prompt-key"
MAX_HORIZON = 4096  # the prediction service answers horizons up to this (API.md)
# BR parameters that have proxy options of their own (not --param)
_OWN_OPTIONS = {"guard": "--guard", "step_overhead": "--step-overhead",
                "patience": "--patience"}
MAX_PROMPT_KEY = 256

PREFILL_PROBE_KV = {"do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                    "remote_port": None}


@dataclass(frozen=True)
class ProxyConfig:
    decode: list[str]
    prefill: list[str] = field(default_factory=list)
    policy: str = "br0"
    predictor_url: str | None = None
    lengths_from: str = "service"  # BR-H's predictions: "service" or "max-tokens"
    batch: int = 64
    bypass: bool = False
    horizon: int = 80
    refresh_steps: int = 10
    pool_max: int = 4096
    pool_ttl_s: float = 60.0
    down_grace_s: float = 10.0  # with no rank up this long, waiting requests get a 503
    active_ttl_s: float = 300.0
    connect_timeout_s: float = 10.0
    engine_timeout_s: float = 120.0
    probe_interval_s: float = 1.0
    reconcile_interval_s: float = 5.0
    prefill_kv_budget: int = 2_000_000
    retries: int = 1
    start_after: int = 0  # the first routing round waits for this many waiting requests
    step_s: float | None = None  # the fleet's decode step: one routing round per step at most
    guard: GuardRule | None = None  # BR's starvation guard (None: idle for brh, always for br0)
    step_overhead: float | None = None  # b / a of the ranks' step time, KV tokens
    patience: int | None = None  # rounds in a row the guard idle may hold one rank back
    # BalanceRouteParams fields by name, as text (--param NAME=VALUE): the rest of BR's
    # settings (BalanceRouteParams.with_settings reads and checks them)
    settings: tuple[tuple[str, str], ...] = ()
    max_body_bytes: int = BODY_LIMIT  # 413 past it (a 128k-token prompt: about 0.5 MB)
    max_inflight_body_bytes: int | None = None  # all bodies held at once; 503 past it
    # (None: BODY_BUDGET, or max_body_bytes if larger)
    tokenizer: str | None = None  # the model's tokenizer.json (or its directory): exact s_i

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode URL is needed")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}")
        if self.lengths_from not in LENGTHS_FROM:
            raise ValueError(f"--lengths-from must be one of {', '.join(LENGTHS_FROM)}")
        if self.policy == "brh" and self.lengths_from == "service" and not self.predictor_url:
            raise ValueError("--policy brh needs --predictor-url (or --lengths-from max-tokens)")
        if self.lengths_from == "max-tokens" and self.predictor_url:
            raise ValueError("--lengths-from max-tokens takes no --predictor-url")
        if self.lengths_from == "max-tokens" and self.policy != "brh":
            raise ValueError("--lengths-from max-tokens is for --policy brh")
        if self.guard is not None and self.guard not in GUARD_RULES:
            raise ValueError(f"--guard must be one of {', '.join(GUARD_RULES)}")
        if self.step_overhead is not None and not self.step_overhead >= 0:
            raise ValueError("--step-overhead must be >= 0 KV tokens")
        if self.patience is not None and (isinstance(self.patience, bool)
                                          or not isinstance(self.patience, int)
                                          or self.patience < 0):
            raise ValueError("--patience must be a whole number of rounds >= 0")
        if self.settings and not self.runs_br:
            raise ValueError(f"--param: --policy {self.policy} has no BR parameters "
                             "(br0 or brh)")
        for name, _ in self.settings:
            if name in _OWN_OPTIONS:
                raise ValueError(f"--param {name}: set it with {_OWN_OPTIONS[name]}")
            if name == "horizon" and self.policy != "brh":
                raise ValueError("--param horizon: BR-0 looks no step ahead (--policy brh)")
        try:
            params = self.router_params()
            params.effective_beta(len(self.decode))  # BR-0's beta is G's
        except ParameterError as exc:
            raise ValueError(f"--param {exc}") from None
        if params.horizon > MAX_HORIZON:
            raise ValueError(f"--param horizon: at most {MAX_HORIZON} (the prediction "
                             "service's bound)")
        if isinstance(self.start_after, bool) or not isinstance(self.start_after, int) \
                or self.start_after < 0:
            raise ValueError("--start-after must be a whole number of requests >= 0")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < MIN_BODY_LIMIT:
            raise ValueError(f"--max-body-bytes must be a whole number >= {MIN_BODY_LIMIT}")
        if self.max_inflight_body_bytes is not None and (
                isinstance(self.max_inflight_body_bytes, bool)
                or not isinstance(self.max_inflight_body_bytes, int)
                or self.max_inflight_body_bytes < self.max_body_bytes):
            raise ValueError("--max-inflight-body-bytes must be a whole number >= "
                             "--max-body-bytes")

    @property
    def runs_br(self) -> bool:
        """Whether ``policy`` routes by BR (BR-0 or BR-H), not a baseline."""
        return self.policy in BR_POLICIES

    def router_params(self) -> BalanceRouteParams:
        """BR's parameters: BR-H at ``horizon`` (``--policy brh``) or BR-0, the guard, step
        overhead and patience options, then ``settings`` (``--param``)."""
        params = (BalanceRouteParams(horizon=self.horizon) if self.policy == "brh"
                  else BalanceRouteParams.br0())
        params = replace(params, guard=self.guard, step_overhead=self.step_overhead,
                         patience=self.patience)
        return params.with_settings(dict(self.settings))


class ProxyError(Exception):
    def __init__(self, status: int, message: str, kind: str = "proxy_error",
                 body: bytes | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.body = body  # an engine's own answer, relayed as it came
        self.headers = headers

    def response(self) -> Response:
        if self.body is not None:
            return Response(self.body, status_code=self.status, media_type="application/json",
                            headers=self.headers)
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "code": self.status}}, status_code=self.status,
                            headers=self.headers)


# A rank's answers that mean "busy, nothing ran": the request goes to another rank, and the
# rank is held back for its Retry-After (proxy.engines.EngineSet.hold).
BUSY = (429, 503)


def upstream_error(status: int, content: bytes, who: str,
                   headers: dict[str, str] | None = None) -> ProxyError:
    """A decode rank's answer other than 200, for the client, with ``headers`` (a
    ``Retry-After``): a 4xx, or a 503, with an error object (the engine refusing the request,
    in its own words) goes through as the engine wrote it; anything else is a proxy error
    naming the rank."""
    if 400 <= status < 500 or status == 503:
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict) and (isinstance(answer.get("error"), dict)
                                         or answer.get("object") == "error"):
            # OpenAI's {"error": {...}}, or {"object": "error", "message": ...} (SGLang, vLLM)
            return ProxyError(status, str((answer.get("error") or answer).get("message")),
                              "upstream_error", body=content, headers=headers)
    return ProxyError(status, f"{who}: {content[:500].decode(errors='replace')}",
                      "upstream_error", headers=headers)


def _forwarded_headers(request: Request) -> tuple[dict[str, str], str | None]:
    """The headers passed on to the ranks (``Authorization``), and what is wrong with them
    (None: nothing): HTTP header values are ASCII."""
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    if not all(v.isascii() for v in headers.values()):
        return headers, "the Authorization header must be ASCII text"
    return headers, None


class StreamCut(Exception):
    """The upstream stream ended without a finish (engine died, connection cut, timeout)."""


# With --tokenizer, a body larger than this is counted on a worker thread, not on the event
# loop (encoding a long prompt takes milliseconds; other requests' tokens are relayed meanwhile)
INLINE_COUNT_BYTES = 16_384


@dataclass(eq=False)
class Call:
    """One client request through the proxy."""

    base_id: str
    chat: bool
    client_stream: bool
    client_usage: bool
    headers: dict[str, str]
    request_id: str = ""
    rank: int | None = None
    response: httpx.Response | None = None
    telemetry: StreamTelemetry | None = None
    prefill_instance: int | None = None
    prefill_tokens: int = 0
    outcome: str = "cancelled"
    closed: bool = False
    prompt_key: str | None = None  # the client's X-Prompt-Key; else the prompt text's hash
    body_bytes: int = 0
    raw_estimate: int = 0  # the text estimate before calibration (0: counted, not estimated)


class PrefillBudget:
    """Per prefill instance: KV tokens held by handles not yet consumed by a decode rank."""

    def __init__(self, instances: int, budget: int) -> None:
        self.held = [0] * instances
        self.budget = budget
        self.changed = asyncio.Condition()

    async def acquire(self, tokens: int, up: list[bool]) -> int:
        async with self.changed:
            while True:
                fits = [i for i, held in enumerate(self.held)
                        if up[i] and (held + tokens <= self.budget or held == 0)]
                if fits:
                    instance = min(fits, key=lambda i: (self.held[i], i))
                    self.held[instance] += tokens
                    return instance
                await self.changed.wait()

    async def release(self, instance: int, tokens: int) -> None:
        async with self.changed:
            self.held[instance] -= tokens
            self.changed.notify_all()


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        G = len(config.decode)
        capacity = config.batch * (2 if config.bypass else 1)
        params = config.router_params()
        # s_i: the model's own count with --tokenizer, else the estimate (proxy.tokens)
        self.count: Callable[[dict[str, Any]], int] = (
            PromptCounter.load(config.tokenizer) if config.tokenizer else prompt_tokens)
        # without a tokenizer, the estimate's bias learned from the engines' own counts
        self.calibration = PromptCalibration()
        self.predictor: BackgroundPredictor | None = None
        self.lengths: MaxTokensPredictor | None = None
        predictor: Predictor | None = None
        if config.policy == "brh" and config.lengths_from == "max-tokens":
            self.lengths = MaxTokensPredictor()
            predictor = self.lengths
        elif config.policy == "brh" and config.predictor_url:
            inner = HttpPredictor(config.predictor_url, id_prefix=f"proxy-{uuid.uuid4().hex[:6]}-")
            self.predictor = BackgroundPredictor(inner, end_shape=params.end_shape)
            predictor = self.predictor
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.engine_timeout_s, connect=config.connect_timeout_s,
                                  pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=4096))
        self.pending = PendingPool(config.pool_max)
        self.engines = EngineSet(config.decode, self.http, self.metrics, self._wake,
                                 config.probe_interval_s)
        baseline = not config.runs_br
        base = make_policy(config.policy if baseline else ("brh" if params.horizon else "br0"),
                           params=params)
        self.policy = RankMaskPolicy(base, self.engines.up)
        # BR-0/BR-H: RouterClient builds (and may rebuild, adopting the service's
        # recommendation) the policy; the same mask wraps it each time.
        self.client = RouterClient(
            RouterConfig(G, capacity, params, refresh_steps=config.refresh_steps,
                         pool_ttl_s=config.pool_ttl_s, active_ttl_s=config.active_ttl_s),
            predictor, metrics=self.metrics.router,
            policy=self.policy if baseline else None,
            wrap=None if baseline else self.policy.around)
        self.dispatcher = Dispatcher(self.client, self.pending, self.metrics, self.policy,
                                     self.engines.up,
                                     round_interval_s=config.step_s or 0.01,
                                     min_round_s=config.step_s or 0.0,
                                     start_after=config.start_after,
                                     alive=self.engines.any_alive,
                                     down_grace_s=config.down_grace_s)
        self.prefills = (EngineSet(config.prefill, self.http, self.metrics, self._wake,
                                   config.probe_interval_s, kind="prefill")
                         if config.prefill else None)
        self.budget = PrefillBudget(len(config.prefill), config.prefill_kv_budget)
        self.tasks: list[asyncio.Task[None]] = []
        self.calls = 0

    def _wake(self) -> None:
        self.dispatcher.wake()

    # -- lifecycle --------------------------------------------------------------------------
    async def startup(self) -> None:
        await self.engines.check_all()
        if self.prefills is not None:
            await self.prefills.check_all()
        self._log_start()
        self.tasks = [
            asyncio.ensure_future(self.dispatcher.run()),
            asyncio.ensure_future(self.dispatcher.reaper(1.0)),
            asyncio.ensure_future(self.engines.reconcile_loop(
                self.client, self.pending, self.config.reconcile_interval_s)),
        ]
        if self.prefills is not None:
            self.tasks.append(asyncio.ensure_future(self.prefills.reconcile_loop(
                self.client, self.pending, self.config.reconcile_interval_s)))
        if self.predictor is not None:
            reporter = getattr(self.predictor.inner, "reporter", None)
            if reporter is not None:
                reporter.start()

    def _log_start(self) -> None:
        config = self.config
        up = sum(engine.up for engine in self.engines.engines)
        log.info("routing with %s over %d decode ranks of %d slots (%d up)%s%s",
                 config.policy, len(config.decode), config.batch, up,
                 f", {len(config.prefill)} prefill instances" if config.prefill else "",
                 f", predictions from {config.predictor_url}" if self.predictor else
                 ", lengths from max_tokens" if self.lengths else "")

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.engines.close()
        if self.prefills is not None:
            self.prefills.close()
        await self.http.aclose()
        if self.predictor is not None:
            self.predictor.close()

    # -- one request ------------------------------------------------------------------------
    async def handle(self, request: Request, path: str, chat: bool) -> Response:
        try:
            raw = await request.body()
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (orjson.JSONDecodeError, ValueError) as exc:
            self.metrics.requests.labels("invalid").inc()
            return ProxyError(400, f"invalid JSON body: {exc}", "invalid_request_error"
                              ).response()
        headers, problem = _forwarded_headers(request)
        prompt_key = request.headers.get(PROMPT_KEY_HEADER)
        if prompt_key is not None and not 1 <= len(prompt_key) <= MAX_PROMPT_KEY:
            problem = problem or (f"the X-Prompt-Key header must be 1 to {MAX_PROMPT_KEY} "
                                  "characters")
        problem = problem or body_problem(body, chat)
        if problem is not None:
            self.metrics.requests.labels("invalid").inc()
            return ProxyError(400, problem, "invalid_request_error").response()
        self.calls += 1
        call = Call(f"br-{uuid.uuid4().hex}", chat, bool(body.get("stream")),
                    bool((body.get("stream_options") or {}).get("include_usage")), headers,
                    prompt_key=prompt_key, body_bytes=len(raw))
        start = asyncio.ensure_future(self.start(call, body, path))
        if not await self._race(start, request):
            await self.close(call)
            return Response(status_code=499)
        try:
            start.result()
        except ProxyError as exc:
            call.outcome = "rejected" if exc.status in (429, 503) else "error"
            await self.close(call)
            return exc.response()
        except Exception:  # a bug of ours: the slot and the pool entry are freed all the same
            log.exception("unexpected error routing %s", call.base_id)
            call.outcome = "error"
            await self.close(call)
            return ProxyError(503, "proxy error; retry later", "proxy_error").response()
        if call.client_stream:
            return StreamingResponse(self.relay(call), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        collect = asyncio.ensure_future(self.collect(call))
        if not await self._race(collect, request):
            await self.close(call)
            return Response(status_code=499)
        try:
            answer = collect.result()
        except StreamCut as exc:
            await self.close(call)
            return ProxyError(502, str(exc), "upstream_error").response()
        await self.close(call)
        return Response(orjson.dumps(answer), media_type="application/json")

    @staticmethod
    async def _race(task: asyncio.Future[Any], request: Request) -> bool:
        """Wait for ``task`` unless the client leaves first (then cancel it; False)."""
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task.done():
            return True
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return False

    async def start(self, call: Call, body: dict[str, Any], path: str) -> None:
        """Prefill (if any), pool, routing, and the upstream stream's headers."""
        estimate = (await asyncio.to_thread(self.count, body)
                    if self.config.tokenizer and call.body_bytes > INLINE_COUNT_BYTES
                    else self.count(body))
        if not self.config.tokenizer and calibratable(body):
            call.raw_estimate = estimate
            estimate = self.calibration.apply(estimate)
        source = body.get("messages") if call.chat else body.get("prompt")
        key = call.prompt_key or (key_of_text(orjson.dumps(source).decode())
                                  if source is not None else None)
        upstream = dict(body)
        upstream["stream"] = True
        upstream["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        tokens = estimate
        if self.prefills is not None:
            tokens, handle = await self._prefill(call, body, path, estimate)
            upstream["kv_transfer_params"] = handle
        content = orjson.dumps(upstream)
        # A rank that refuses the connection is marked down, so routing again cannot pick it:
        # such attempts are bounded by the rank count and do not use up ``retries``, which
        # bounds only the ambiguous failures (a kept-alive connection closed under us).
        # A rank answering busy (429, 503) is held back and the request routed again; once as
        # many refusals as ranks, the last goes to the client, with a Retry-After.
        ambiguous, refusals, refused = 0, 0, None
        for attempt in range(1 + self.config.retries + len(self.config.decode)):
            if ambiguous > self.config.retries:
                break
            call.request_id = call.base_id if attempt == 0 else f"{call.base_id}-r{attempt}"
            if not self.engines.any_alive():  # nothing to wait for in the pool: say so now
                raise self._no_rank_up()
            if self.lengths is not None:
                self.lengths.expect(call.request_id, body.get("max_completion_tokens",
                                                              body.get("max_tokens")))
            rank = await self._admit(call, tokens, key)
            call.rank = rank
            try:
                request = self.http.build_request(
                    "POST", self.engines.url(rank) + path, content=content,
                    headers={"content-type": "application/json", **call.headers})
                call.response = await self.http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing ran there: free the slot and route again, to another rank.
                self.engines.mark_down(rank, f"connect: {type(exc).__name__}")
                self._end(call, "error")
                continue
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                # A kept-alive connection the rank had just closed (no response began): the
                # rank is not down; route again. A dead rank refuses the next connection.
                self._end(call, "error")
                ambiguous += 1
                continue
            except httpx.HTTPError as exc:
                self.engines.mark_down(rank, f"send: {type(exc).__name__}")
                self._end(call, "error")
                raise ProxyError(502, f"decode rank {rank} failed: {exc!r}",
                                 "upstream_error") from exc
            status = call.response.status_code
            if status != 200:
                answer = await call.response.aread()  # (``content`` is sent again on a retry)
                self._end(call, "error")
                asked = call.response.headers.get("retry-after")
                if status in BUSY:
                    self.engines.hold(rank, retry_after_s(asked), f"busy {status}")
                    refusals += 1
                    refused = upstream_error(status, answer, f"decode rank {rank}")
                    if refusals < len(self.config.decode):
                        continue
                    raise self._busy_answer(refused)
                raise upstream_error(status, answer, f"decode rank {rank}",
                                     {"retry-after": asked} if asked else None)
            call.telemetry = self.client.stream(call.request_id,
                                                fixed_length=body.get("ignore_eos") is True)
            return
        if refused is not None:
            raise self._busy_answer(refused)
        raise ProxyError(502, "no decode rank accepted the request", "upstream_error")

    def _busy_answer(self, refusal: ProxyError) -> ProxyError:
        """A rank's busy answer for the client, with a ``Retry-After`` of the whole seconds
        until a held rank may be routed to again (at least 1)."""
        wait = self.engines.held_for()
        refusal.headers = {"retry-after": str(max(1, math.ceil(wait or 0.0)))}
        return refusal

    def _end(self, call: Call, reason: str) -> None:
        self.client.fleet.finish(call.request_id, reason, time.monotonic())
        self.pending.leave(call.request_id)
        self.dispatcher.wake()

    async def _admit(self, call: Call, tokens: int, key: str | None) -> int:
        now = time.monotonic()
        try:
            entry = self.pending.join(call.request_id, now)
        except PoolFull:
            self.metrics.pool_rejected.inc()
            raise ProxyError(429, "the prompt pool is full", "rate_limit_error") from None
        if not self.client.on_prefilled(call.request_id, tokens, now, key):
            self.pending.leave(call.request_id)
            raise ProxyError(500, "duplicate request id")
        self.dispatcher.wake()
        try:
            return await entry.future
        except NoRankUp:  # none came back within --down-grace
            raise self._no_rank_up() from None
        except PoolExpired:
            raise ProxyError(503, "no decode slot within the pool TTL",
                             "service_unavailable") from None

    def _no_rank_up(self) -> ProxyError:
        """The 503 of a request no decode rank is up to take: at once, or after waiting in
        the pool for ``--down-grace``; retry once the ranks are probed again."""
        return ProxyError(503, "no decode rank is up", "service_unavailable",
                          headers={"retry-after": str(max(
                              1, math.ceil(self.config.probe_interval_s)))})

    async def _prefill(self, call: Call, body: dict[str, Any], path: str,
                       estimate: int) -> tuple[int, Any]:
        assert self.prefills is not None
        if not self.prefills.any_up():
            raise ProxyError(503, "no prefill instance is up", "service_unavailable")
        instance = await self.budget.acquire(estimate, self.prefills.up)
        call.prefill_instance, call.prefill_tokens = instance, estimate
        probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        probe.pop("min_tokens", None)  # an engine refuses min_tokens above max_tokens 1
        probe.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PROBE_KV))
        if "max_completion_tokens" in probe:
            probe["max_completion_tokens"] = 1
        try:
            response = await self.http.post(self.prefills.url(instance) + path,
                                             content=orjson.dumps(probe),
                                             headers={"content-type": "application/json",
                                                      **call.headers})
        except httpx.HTTPError as exc:
            self.prefills.mark_down(instance, f"prefill: {type(exc).__name__}")
            raise ProxyError(502, f"prefill instance {instance} failed: {exc!r}",
                             "upstream_error") from exc
        if response.status_code != 200:  # the probe is ours, not the client's: not relayed
            raise ProxyError(response.status_code, f"prefill instance {instance}: "
                             f"{response.content[:500].decode(errors='replace')}",
                             "upstream_error")
        answer = orjson.loads(response.content)
        reported = (answer.get("usage") or {}).get("prompt_tokens")
        tokens = int(reported or estimate)
        if reported:  # the prefill engine's own count
            self._calibrate(call, tokens)
        return tokens, answer.get("kv_transfer_params")

    async def _release_prefill(self, call: Call) -> None:
        if call.prefill_instance is not None:
            instance, call.prefill_instance = call.prefill_instance, None
            await self.budget.release(instance, call.prefill_tokens)

    async def events(self, call: Call) -> AsyncIterator[list[tuple[dict[str, Any], bytes]]]:
        """Upstream chunks as (chunk, data) per network read, with telemetry; raises StreamCut.

        Each event is split out of the bytes and parsed once (the telemetry counts tokens from
        the parsed chunk; the data bytes are relayed as they came)."""
        assert call.response is not None and call.telemetry is not None
        telemetry = call.telemetry
        parser = telemetry.parser
        event = telemetry.event
        clock = time.monotonic
        try:
            async for raw in call.response.aiter_raw():
                if call.prefill_instance is not None:
                    await self._release_prefill(call)  # the first decode chunk: KV handed off
                now = clock()
                batch = []
                for data in parser.events(raw):
                    chunk = event(data, now)
                    if chunk is not None:
                        batch.append((chunk, data))
                if batch:
                    yield batch
        except httpx.HTTPError as exc:
            telemetry.close(clock())
            if call.rank is not None and not isinstance(exc, httpx.ReadTimeout):
                self.engines.mark_down(call.rank, f"stream: {type(exc).__name__}")
            call.outcome = "error"
            raise StreamCut(f"decode rank {call.rank} stream failed: {exc!r}") from exc
        now = clock()
        tail = [(chunk, data) for data in parser.close_events()
                if (chunk := event(data, now)) is not None]
        if tail:
            yield tail
        ended = telemetry.close(now)
        if telemetry.prompt_tokens is not None:
            self._calibrate(call, telemetry.prompt_tokens)
        call.outcome = "tool_calls" if telemetry.reason in NATURAL_TOOL_FINISHES else ended
        if ended == "error":
            raise StreamCut(f"decode rank {call.rank} ended the stream without a finish")

    async def relay(self, call: Call) -> AsyncIterator[bytes]:
        drop_usage = not call.client_usage
        try:
            async for batch in self.events(call):
                out = b"".join(b"data: " + data + b"\n\n" for chunk, data in batch
                               if not (drop_usage and is_usage_only(chunk)))
                if out:
                    yield out
            yield b"data: [DONE]\n\n"
        except StreamCut as exc:
            yield b"data: " + orjson.dumps({"error": {"message": str(exc),
                                                      "type": "upstream_error",
                                                      "code": 502}}) + b"\n\n"
        finally:
            await self.close(call)

    async def collect(self, call: Call) -> dict[str, Any]:
        aggregate = Aggregate(call.chat)
        async for batch in self.events(call):
            for chunk, _ in batch:
                aggregate.add(chunk)
        return aggregate.result()

    def _calibrate(self, call: Call, reported: int) -> None:
        """An engine's count of a prompt the proxy estimated from text: learn the estimate's
        bias (once per call)."""
        if call.raw_estimate > 0:
            self.calibration.observe(call.raw_estimate, reported)
            call.raw_estimate = 0
            self.metrics.prompt_factor.set(self.calibration.factor)

    async def close(self, call: Call) -> None:
        """Free everything the call holds; idempotent, safe in a cancelled task."""
        if call.closed:
            return
        call.closed = True
        with anyio.CancelScope(shield=True):
            fleet = self.client.fleet
            if call.request_id and (call.request_id in fleet.pool
                                    or call.request_id in fleet.active):
                self.client.on_cancel(call.request_id, time.monotonic())
                call.outcome = "cancelled"
            self.pending.leave(call.request_id)
            await self._release_prefill(call)
            if call.response is not None:
                with contextlib.suppress(Exception):
                    await call.response.aclose()
            self.metrics.requests.labels(call.outcome).inc()
            self.dispatcher.wake()

    # -- other endpoints --------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        headers, problem = _forwarded_headers(request)
        if problem is not None:
            return ProxyError(400, problem, "invalid_request_error").response()
        for engine in self.engines.engines:
            if not engine.up:
                continue
            try:
                response = await self.http.get(f"{engine.url}/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type="application/json")
        return ProxyError(503, "no decode rank is up", "service_unavailable").response()

    async def metrics_endpoint(self, request: Request) -> Response:
        self.dispatcher.publish()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def state(self, request: Request) -> Response:
        """The mirrored state, for tests and debugging (``check`` raises nothing if sound)."""
        fleet = self.client.fleet
        problem = None
        try:
            fleet.check()
        except AssertionError as exc:
            problem = str(exc) or "invariant violated"
        counters = fleet.counters
        return JSONResponse({
            "invariants": problem or "ok",
            "pool": len(fleet.pool), "active": len(fleet.active),
            "per_rank": [len(members) for members in fleet.per_worker],
            "up": list(self.engines.up), "pending": len(self.pending.entries),
            "policy": self.policy.name, "rounds": self.dispatcher.rounds,
            "fallback_rounds": self.client.fallback_rounds,
            "brh_active": self.client.use_predictions,
            # BR's parameters as the router runs them now (--param, or an adopted
            # recommendation)
            "params": (dataclasses.asdict(self.client.params)
                       if self.config.runs_br else None),
            "counters": {name: getattr(counters, name) for name in counters.__dataclass_fields__},
        })


BODY_ERRORS = {413: ("invalid_request_error", " (--max-body-bytes)"),
               503: ("server_busy", " (--max-inflight-body-bytes)"), 408: ("timeout", "")}


def _body_error(status: int, message: str) -> dict[str, Any]:
    kind, option = BODY_ERRORS.get(status, ("proxy_error", ""))
    return {"error": {"message": message + option, "type": kind, "code": status}}


async def _not_routed(request: Request, exc: Exception) -> Response:
    """A path the proxy does not serve (404), or a method it does not take there (405), in
    OpenAI's error shape, as an engine would answer."""
    status = getattr(exc, "status_code", 404)
    message = (f"{request.method} is not allowed on {request.url.path}" if status == 405
               else f"no route {request.url.path}")
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "code": status}},
                        status_code=status, headers=getattr(exc, "headers", None))


def build_app(config: ProxyConfig) -> Starlette:
    proxy = Proxy(config)

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions", chat=False)

    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions", chat=True)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = proxy.engines.any_up()
        return JSONResponse({"ready": ready, "up": list(proxy.engines.up)},
                            status_code=200 if ready else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.startup()
        try:
            yield
        finally:
            await proxy.shutdown()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/metrics", proxy.metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/proxy/state", proxy.state, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={404: _not_routed, 405: _not_routed})

    def body_refused(status: int, message: str) -> dict[str, Any]:
        # counted with the requests the proxy refuses itself: a 413 is invalid input (as a
        # 400), the budget's 503 a rejection (as the pool's 429), a 408 an error
        outcome = {413: "invalid", 503: "rejected"}.get(status, "error")
        proxy.metrics.requests.labels(outcome).inc()
        return _body_error(status, message)

    # a body past the limit gets its 413 before it is read whole, let alone parsed
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, error=body_refused,
                       budget=body_budget(config.max_inflight_body_bytes,
                                          config.max_body_bytes))
    app.state.proxy = proxy
    return app
