"""``balanceroute bench serve``: replay a trace against an OpenAI-compatible endpoint.

Each trace request becomes a streaming ``POST /v1/completions`` whose prompt is a list of
``prompt_tokens`` token ids (so every server counts it exactly), with ``max_tokens`` set to the
trace's output length and ``ignore_eos`` (as ``vllm bench serve`` does). The ids differ from
request to request (their first two encode its index), so that no two requests share a prompt
text by accident: a proxy keys them by that text (until 2026-12-04 the ids depended on the
length alone, so every request of one prompt length shared a key, and the service's ExactMatch
learned from that coincidence). A request with a prompt key in the trace sends it as
``X-Prompt-Key``, which ``balanceroute proxy`` uses instead of the text's hash. Arrivals:

- by default at the trace's own times (traces without times need ``--rate``);
- ``--rate R``: Poisson arrivals at R requests/s (seeded); ``inf`` sends all at once;
- ``--load L``: the trace's times rescaled (burst shape kept) so that arrivals per decode step
  are ``L * workers * batch / mean(output)``, the step taken from the cost model at a full
  batch (``--workers``, ``--batch``, ``--step-cost``, ``--time-scale`` describe the fleet);
- ``--max-concurrency C`` caps requests in flight (a closed loop when arrivals outpace it).

Reported like ``vllm bench serve``: request and output-token throughput over the wall-clock
run, and mean / P50 / P90 / P99 of TTFT (time to the first token), TPOT (per output token
after the first), ITL (between tokens) and end-to-end latency, in milliseconds.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson

from router_client.simulator import DEFAULT_STEP_COST
from router_client.sse import SSEParser
from router_client.traces import Trace


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class LoadConfig:
    url: str
    rate: float | None = None
    load: float | None = None
    max_concurrency: int | None = None
    workers: int = 8
    batch: int = 64
    step_cost: tuple[float, float] = DEFAULT_STEP_COST
    time_scale: float = 1.0
    seed: int = 0
    model: str | None = None
    timeout_s: float = 600.0


def arrival_times(trace: Trace, config: LoadConfig) -> np.ndarray:
    """Send times in seconds from the start."""
    n = len(trace)
    rng = np.random.default_rng(config.seed)
    if config.rate is not None:
        if math.isinf(config.rate):
            return np.zeros(n)
        return np.cumsum(rng.exponential(1.0 / config.rate, n)) - 0.0
    if trace.arrival_s is None:
        raise ValueError(f"trace {trace.name} has no arrival times: give --rate")
    times = np.asarray(trace.arrival_s, dtype=np.float64)
    times = times - times[0]
    if config.load is None:
        return times
    a, b = config.step_cost
    mean_out = float(np.mean(trace.output_tokens))
    full_rank = config.batch * (float(np.mean(trace.prompt_tokens)) + mean_out / 2)
    step_s = (a * full_rank + b) / config.time_scale
    target_rate = config.load * config.workers * config.batch / mean_out / step_s
    span = times[-1] if times[-1] > 0 else 1.0
    return times * ((n - 1) / target_rate) / span if n > 1 else times


def token_ids(n: int, index: int = 0) -> list[int]:
    """``n`` token ids, the first two encoding ``index`` (distinct for indices below 9e8)."""
    head = [100 + index % 30000, 100 + (index // 30000) % 30000]
    return [*head, *(100 + (i * 7919) % 30000 for i in range(2, n))][:n]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: int,
                      output: int, index: int = 0, prompt_key: str | None = None
                      ) -> RequestResult:
    result = RequestResult(prompt)
    body = {"model": model, "prompt": token_ids(prompt, index), "max_tokens": output,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"content-type": "application/json"}
    if prompt_key is not None:
        headers["x-prompt-key"] = prompt_key
    started = time.perf_counter()
    last = started
    try:
        async with client.stream("POST", url, content=orjson.dumps(body),
                                 headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            parser = SSEParser()
            tokens = 0
            async for raw in response.aiter_raw():
                for data in parser.feed(raw):
                    if data.strip() == "[DONE]":
                        continue
                    chunk = orjson.loads(data)
                    if chunk.get("error"):
                        result.error = str(chunk["error"].get("message"))
                        return result
                    if any(c.get("text") or (c.get("delta") or {}).get("content")
                           for c in chunk.get("choices") or []):
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - started
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        tokens += 1
                    usage = chunk.get("usage")
                    if usage:
                        tokens = int(usage.get("completion_tokens") or tokens)
            result.output_tokens = tokens
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - started
    return result


def _stats(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"mean_{prefix}_ms": None, f"p50_{prefix}_ms": None, f"p90_{prefix}_ms": None,
                f"p99_{prefix}_ms": None}
    array = np.asarray(values) * 1000.0
    return {f"mean_{prefix}_ms": float(array.mean()),
            f"p50_{prefix}_ms": float(np.percentile(array, 50)),
            f"p90_{prefix}_ms": float(np.percentile(array, 90)),
            f"p99_{prefix}_ms": float(np.percentile(array, 99))}


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": output,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
    }
    summary.update(_stats([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"))
    summary.update(_stats(tpot, "tpot"))
    summary.update(_stats([x for r in ok for x in r.itl_s], "itl"))
    summary.update(_stats([r.e2e_s for r in ok], "e2el"))
    errors = sorted({r.error for r in results if r.error})
    summary["errors"] = errors[:10]
    return summary


async def run(trace: Trace, config: LoadConfig) -> tuple[dict[str, Any], list[RequestResult]]:
    base = config.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    times = arrival_times(trace, config)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=10.0,
                                                       pool=None), limits=limits) as client:
        model = config.model
        if model is None:
            try:
                listing = (await client.get(f"{base}/v1/models")).json()
                model = str(listing["data"][0]["id"])
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                model = "default"
        gate = asyncio.Semaphore(config.max_concurrency or len(trace) or 1)
        started = time.perf_counter()

        async def fire(i: int) -> RequestResult:
            delay = started + float(times[i]) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                return await one_request(client, f"{base}/v1/completions", model,
                                         int(trace.prompt_tokens[i]),
                                         int(trace.output_tokens[i]), i,
                                         trace.prompt_keys[i])

        results = await asyncio.gather(*(fire(i) for i in range(len(trace))))
        duration = time.perf_counter() - started
    summary = summarize(list(results), duration)
    summary["url"] = config.url
    summary["trace"] = trace.name
    summary["config"] = {k: v for k, v in asdict(config).items() if k != "url"}
    return summary, list(results)


def format_summary(summary: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        value = summary.get(key)
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "============ Serving Benchmark Result ============",
        f"Successful requests:          {summary['completed']}",
        f"Failed requests:              {summary['failed']}",
        f"Benchmark duration (s):       {summary['duration_s']:.2f}",
        f"Total input tokens:           {summary['total_input_tokens']}",
        f"Total generated tokens:       {summary['total_output_tokens']}",
        f"Request throughput (req/s):   {summary['request_throughput']:.2f}",
        f"Output token throughput (tok/s): {summary['output_throughput']:.2f}",
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el")):
        lines.append(f"{name:5} ms  mean {ms(f'mean_{key}_ms')}  p50 {ms(f'p50_{key}_ms')}  "
                     f"p90 {ms(f'p90_{key}_ms')}  p99 {ms(f'p99_{key}_ms')}")
    for error in summary.get("errors") or []:
        lines.append(f"error: {error}")
    return "\n".join(lines)
