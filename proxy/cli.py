"""Command line of the serving side: ``proxy``, ``emulate`` and ``bench serve``.

``add_commands(subparsers, bench_subparsers)`` registers them on the ``balanceroute`` parser;
each sets ``handler`` (the function the main CLI calls with the parsed arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from predictor.asgi import BODY_BUDGET, BODY_LIMIT, MIN_BODY_LIMIT
from router_client.errors import ParameterError
from router_client.simulator import DEFAULT_STEP_COST, parse_step_cost

from . import LENGTHS_FROM, POLICIES

T = TypeVar("T")


def _urls(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise argparse.ArgumentTypeError(f"expected http(s) URLs separated by commas: {text!r}")
    return urls


def _step_cost(text: str) -> tuple[float, float]:
    try:
        return parse_step_cost(text)
    except ParameterError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def _number(parse: Callable[[str], T], ok: Callable[[T], bool], expected: str,
            bound: str) -> Callable[[str], T]:
    """An argparse type: ``parse`` the text ("expected ..." if it cannot), then ``ok`` must
    hold (``bound`` if not)."""
    def check(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(bound)
        return value

    return check


# NaN fails every comparison; an infinite overhead (a step with no per-token cost) is allowed
_overhead = _number(float, lambda v: v >= 0, "a number of KV tokens", "must be >= 0 KV tokens")
_rounds = _number(int, lambda v: v >= 0, "a whole number of rounds", "must be >= 0 rounds")
_requests = _number(int, lambda v: v >= 0, "a whole number of requests",
                    "must be >= 0 requests")
_positive_float = _number(float, lambda v: 0 < v < math.inf, "a number",
                          "must be a finite number > 0")
_body_bytes = _number(int, lambda v: v >= MIN_BODY_LIMIT, "a whole number of bytes",
                      f"must be >= {MIN_BODY_LIMIT} bytes")
_rate = _number(float, lambda v: v > 0, "a number or 'inf'", "must be > 0 ('inf': all at once)")
_requests = _number(int, lambda v: v >= 0, "a whole number of requests", "must be >= 0 requests")
_count = _number(int, lambda v: v >= 1, "a whole number", "must be >= 1")
_none_or_more = _number(int, lambda v: v >= 0, "a whole number", "must be >= 0")
_port = _number(int, lambda v: 1 <= v <= 65535, "a port number", "must be a port, 1 to 65535")


def add_commands(sub: Any, bench_sub: Any) -> None:
    cost = "A,B: step time = A * max_g L_g + B seconds (default {:g},{:g})".format(
        *DEFAULT_STEP_COST)

    proxy = sub.add_parser("proxy", help="OpenAI-compatible BalanceRoute proxy for DP ranks")
    proxy.add_argument("--decode", type=_urls, required=True,
                       help="decode rank URLs, one per DP rank: http://h:8000,http://h:8001")
    proxy.add_argument("--prefill", type=_urls, default=[],
                       help="prefill instance URLs (two-phase requests with kv_transfer_params)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=_port, default=8080)
    proxy.add_argument("--policy", default="br0", choices=POLICIES)
    proxy.add_argument("--predictor-url", default=None,
                       help="prediction service for BR-H (required with --policy brh; BR-H "
                       "routes as BR-0 while the service is unreachable or its answers drift)")
    proxy.add_argument("--lengths-from", default="service", choices=LENGTHS_FROM,
                       help="BR-H's predictions: the service at --predictor-url (default), or "
                       "each request's max_tokens as its length (true lengths where clients "
                       "send ignore_eos, as benchmark replays do: BR-H with perfect "
                       "information through the proxy, a diagnostic)")
    proxy.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="the served model's tokenizer.json (or its directory, with "
                       "tokenizer_config.json's chat template): prompt tokens counted exactly "
                       "(default: about four characters a token, far off for Chinese text)")
    proxy.add_argument("--batch", type=_count, default=64,
                       help="B: concurrent requests per decode rank (default 64)")
    proxy.add_argument("--bypass", action="store_true",
                       help="route at arrival; up to 2*B per rank (engine queues the excess)")
    proxy.add_argument("--pool-max", type=_count, default=4096, help="pool bound (429 beyond)")
    proxy.add_argument("--down-grace", type=_positive_float, default=10.0, metavar="SECONDS",
                       help="with no decode rank up this long, requests waiting in the pool "
                       "get a 503 with Retry-After, as a new request does at once (default 10)")
    proxy.add_argument("--pool-ttl", type=_positive_float, default=60.0,
                       help="seconds a request may wait for a decode slot (default 60)")
    proxy.add_argument("--engine-timeout", type=_positive_float, default=120.0,
                       help="seconds without a byte from a rank before the stream fails")
    proxy.add_argument("--step-ms", type=_positive_float, default=None,
                       help="the ranks' decode step in ms: routing rounds at most once per "
                       "step, as the router's step counters assume (default: every event, and "
                       "every 10 ms while requests wait)")
    proxy.add_argument("--start-after", type=_requests, default=0, metavar="N",
                       help="for benchmarks: the first routing round waits until N requests "
                       "wait in the pool (at most 30 s after the first arrives), so that a "
                       "replay's first wave is routed whole, not as it trickles in (default "
                       "0: route at once)")
    proxy.add_argument("--connect-timeout", type=_positive_float, default=10.0,
                       help="seconds to open a connection to a rank before it is marked down "
                       "(default 10: a busy host accepts late, a dead one refuses at once)")
    proxy.add_argument("--guard", default=None, choices=["always", "idle"],
                       help="BR's starvation guard where every candidate overflows a rank's "
                       "margin: always admit the best one (the paper's, br0's default) or "
                       "leave the slot empty this round where that pays (brh's default)")
    proxy.add_argument("--step-overhead", type=_overhead, default=None, metavar="TOKENS",
                       help="the ranks' fixed step cost B/A of step time A*max_load+B, in KV "
                       "tokens, that the guard idle weighs (default 66667: 0.010 s at "
                       "1.5e-7 s per token)")
    proxy.add_argument("--patience", type=_rounds, default=None, metavar="ROUNDS",
                       help="with the guard idle, a rank that has left its free slots empty "
                       "this many routing rounds in a row takes its best request in the next "
                       "(0: never waits; default: no bound). A round comes with every event "
                       "and every 10 ms while requests wait, at most once per --step-ms: set "
                       "--step-ms for a bound in decode steps")
    proxy.add_argument("--param", type=_setting, action="append", default=[],
                       metavar="NAME=VALUE",
                       help="a BR parameter by its name in BalanceRouteParams (repeatable; "
                       "e.g. --param learned_short_pool=true --param beta=16; none/never "
                       "unsets one that may be unset; the README lists them); the guard, "
                       "the step overhead and the patience have their own options")
    proxy.add_argument("--max-body-bytes", type=_body_bytes, default=BODY_LIMIT,
                       metavar="BYTES", help="largest request body accepted; 413 beyond, "
                       f"before it is parsed (default {BODY_LIMIT}; at least {MIN_BODY_LIMIT})")
    proxy.add_argument("--max-inflight-body-bytes", type=_body_bytes, default=None,
                       metavar="BYTES", help="request bodies held at once (read, not yet "
                       "answered; one client address a quarter of it); 503 with Retry-After "
                       f"beyond (default {BODY_BUDGET}, or --max-body-bytes if larger)")
    proxy.add_argument("--prefill-kv-budget", type=_count, default=2_000_000,
                       help="KV tokens one prefill instance may hold for pending hand-offs")
    proxy.set_defaults(handler=cmd_proxy)

    emulate = sub.add_parser("emulate", help="emulated DP decode ranks (a test double)")
    emulate.add_argument("--workers", type=_count, required=True, help="G decode ranks")
    emulate.add_argument("--host", default="127.0.0.1")
    emulate.add_argument("--port", type=_port, default=9000, help="rank g listens on port + g")
    emulate.add_argument("--batch", type=_count, default=64, help="B slots per rank (default 64)")
    emulate.add_argument("--step-cost", type=_step_cost, default=DEFAULT_STEP_COST, help=cost)
    emulate.add_argument("--time-scale", type=_positive_float, default=1.0,
                         help="run this many times faster than the cost model (default 1)")
    emulate.add_argument("--prefill-workers", type=_none_or_more, default=0,
                         help="prefill instances on the ports after the decode ranks")
    emulate.add_argument("--mean-output", type=_positive_float, default=128.0,
                         help="mean output length without ignore_eos (default 128)")
    emulate.add_argument("--seed", type=int, default=0)
    emulate.add_argument("--max-queued-requests", type=_requests, default=None, metavar="N",
                         help="a rank answers 503 when N requests already wait beyond its "
                              "batch, as SGLang's option of that name (default: no bound, as "
                              "vLLM)")
    emulate.add_argument("--start-after", type=_none_or_more, default=0, metavar="N",
                         help="hold the first decode step until N requests have come (or 30 s "
                              "after the first): a benchmark's first wave in the slots at "
                              "step 0, as ab --load backlog's (default 0: step at once)")
    emulate.add_argument("--tokenizer", default=None, metavar="PATH",
                         help="count prompt tokens with this tokenizer.json (or the model "
                              "directory holding it), as the engine would (default: about "
                              "four characters a token)")
    emulate.set_defaults(handler=cmd_emulate)

    serve = bench_sub.add_parser("serve", help="replay a trace against an OpenAI endpoint")
    serve.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    serve.add_argument("--trace", required=True, help="trace file or synth:NAME")
    serve.add_argument("--format", default="auto")
    rate = serve.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_rate, default=None,
                      help="Poisson arrivals at R requests/s ('inf': all at once)")
    rate.add_argument("--load", type=_positive_float, default=None,
                      help="rescale trace times to this load (see --workers, --batch)")
    serve.add_argument("--requests", type=_count, default=None, help="the first N requests")
    serve.add_argument("--max-concurrency", type=_count, default=None)
    serve.add_argument("--workers", type=_count, default=8, help="fleet size for --load")
    serve.add_argument("--batch", type=_count, default=64, help="B for --load")
    serve.add_argument("--step-cost", type=_step_cost, default=DEFAULT_STEP_COST, help=cost)
    serve.add_argument("--time-scale", type=_positive_float, default=1.0)
    serve.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--json", type=Path, default=None)
    serve.set_defaults(handler=cmd_bench_serve)

    fleet = bench_sub.add_parser(
        "proxy-ab", help="policies through the proxy and the emulator vs balanceroute ab")
    fleet.add_argument("--trace", required=True, help="trace file or synth:NAME")
    fleet.add_argument("--format", default="auto")
    fleet.add_argument("--requests", type=_count, default=600, help="the first N (default 600)")
    fleet.add_argument("--workers", type=_count, default=8, help="G decode ranks (default 8)")
    fleet.add_argument("--batch", type=_count, default=16, help="B slots per rank (default 16)")
    fleet.add_argument("--step-cost", type=_step_cost, default=DEFAULT_STEP_COST, help=cost)
    fleet.add_argument("--time-scale", type=_positive_float, default=0.25,
                       help="the emulator's speed-up over the cost model (default 0.25)")
    fleet.add_argument("--policies", default="br0,jsq,rr",
                       help="proxy policies (br0, brh, brh-oracle, jsq, rr, ltl), the first is "
                       "the reference (default br0,jsq,rr); brh asks a prediction service and is "
                       "compared with ab's brh-<the service's auto estimator>; brh-oracle takes "
                       "each request's max_tokens (the trace's true length) as its length")
    fleet.add_argument("--predictor-url", default=None,
                       help="the prediction service brh asks (default: a fresh balanceroute "
                       "serve on SQLite per brh run, learning online from the run)")
    fleet.add_argument("--seed", type=int, default=0)
    fleet.add_argument("--json", type=Path, default=None)
    fleet.set_defaults(handler=cmd_bench_proxy_ab)

    over = bench_sub.add_parser(
        "proxy-overhead", help="bench serve against one emulated rank, directly and proxied")
    over.add_argument("--trace", default="synth:long:n=400,output_mean=64,output_sigma=0.3,"
                      "prompt_mean=500", help="trace file or synth:NAME")
    over.add_argument("--format", default="auto")
    over.add_argument("--requests", type=_count, default=None)
    over.add_argument("--rate", type=_rate, default=10.0,
                      help="Poisson arrivals per second (default 10)")
    over.add_argument("--batch", type=_count, default=64)
    over.add_argument("--step-cost", type=_step_cost, default=DEFAULT_STEP_COST, help=cost)
    over.add_argument("--time-scale", type=_positive_float, default=1.0)
    over.add_argument("--seed", type=int, default=0)
    over.add_argument("--json", type=Path, default=None)
    over.set_defaults(handler=cmd_bench_proxy_overhead)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (it is a dependency off Windows)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _log_to_stderr() -> None:
    """Our log lines on stderr, timestamped: the proxy's and the emulator's from INFO (their
    start), the rest from WARNING (ranks down and back, fallback switches; a failed refresh is
    INFO, one per refresh while the service is away)."""
    logger = logging.getLogger("balanceroute")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        logging.getLogger("balanceroute.proxy").setLevel(logging.INFO)
        logging.getLogger("balanceroute.emulator").setLevel(logging.INFO)


def cmd_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_app

    try:
        config = _proxy_config(args)
        app = build_app(config)  # loads --tokenizer: a bad one is an error here
    except ValueError as exc:  # options that are wrong together, e.g. --policy brh alone
        print(f"balanceroute proxy: error: {exc}", file=sys.stderr)
        return 2
    from .emulator import bind_sockets

    try:  # bound before saying where it listens: a port taken is one clear line
        sockets = bind_sockets(args.host, args.port, 1, backlog=4096)
    except OSError as exc:
        print(f"balanceroute proxy: error: {exc.strerror or exc}", file=sys.stderr)
        return 1
    _log_to_stderr()
    logging.getLogger("balanceroute.proxy").info(
        "balanceroute proxy on http://%s:%d (OpenAI-compatible /v1; /metrics, /readyz)",
        args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_keep_alive=30))  # backlog: the socket's
    try:
        run_async(server.serve(sockets=sockets))
    except KeyboardInterrupt:
        pass
    return 0


def _setting(text: str) -> tuple[str, str]:
    """``--param``'s value: ``NAME=VALUE`` (read and checked by the proxy's configuration)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def _proxy_config(args: argparse.Namespace) -> Any:
    from .app import ProxyConfig

    return ProxyConfig(decode=args.decode, prefill=args.prefill, policy=args.policy,
                       predictor_url=args.predictor_url, lengths_from=args.lengths_from,
                       batch=args.batch, bypass=args.bypass,
                       pool_max=args.pool_max, pool_ttl_s=args.pool_ttl,
                       down_grace_s=args.down_grace,
                       engine_timeout_s=args.engine_timeout,
                       connect_timeout_s=args.connect_timeout,
                       step_s=args.step_ms / 1000 if args.step_ms else None,
                       start_after=args.start_after,
                       prefill_kv_budget=args.prefill_kv_budget, guard=args.guard,
                       step_overhead=args.step_overhead, patience=args.patience,
                       settings=tuple(args.param),
                       max_body_bytes=args.max_body_bytes,
                       max_inflight_body_bytes=args.max_inflight_body_bytes,
                       tokenizer=args.tokenizer)


def cmd_emulate(args: argparse.Namespace) -> int:
    from .emulator import EmulatorConfig, serve
    from .tokenizer import TokenizerError

    last = args.port + args.workers + args.prefill_workers - 1
    if last > 65535:
        print(f"balanceroute emulate: error: --port {args.port} with {args.workers} ranks and "
              f"{args.prefill_workers} prefill instances needs ports up to {last}, past 65535",
              file=sys.stderr)
        return 2
    config = EmulatorConfig(workers=args.workers, batch=args.batch, step_cost=args.step_cost,
                            time_scale=args.time_scale, seed=args.seed,
                            mean_output=args.mean_output, prefill_workers=args.prefill_workers,
                            max_queued=args.max_queued_requests,
                            start_after=args.start_after, tokenizer=args.tokenizer)
    try:
        run_async(serve(config, args.host, args.port, listening=_log_to_stderr))
    except KeyboardInterrupt:
        pass
    except TokenizerError as exc:
        print(f"balanceroute emulate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port taken, a host not of this machine
        print(f"balanceroute emulate: error: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from router_client.traces import load_trace

    from .loadgen import LoadConfig, format_summary, run

    trace = load_trace(args.trace, args.format, args.requests)
    config = LoadConfig(url=args.url, rate=args.rate, load=args.load,
                        max_concurrency=args.max_concurrency, workers=args.workers,
                        batch=args.batch, step_cost=args.step_cost, time_scale=args.time_scale,
                        seed=args.seed, model=args.model)
    if args.rate is None and args.load is None and trace.arrival_s is None:
        config = LoadConfig(**{**config.__dict__, "rate": math.inf})
    summary, _ = run_async(run(trace, config))
    print(format_summary(summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


def cmd_bench_proxy_ab(args: argparse.Namespace) -> int:
    from router_client.traces import load_trace

    from .fleetbench import BENCH_POLICIES, FleetBenchConfig, compare, format_rows

    trace = load_trace(args.trace, args.format, args.requests)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in BENCH_POLICIES]
    if unknown or not policies:
        print(f"error: --policies: {', '.join(unknown) or 'none given'}: the proxy's policies "
              f"are {', '.join(BENCH_POLICIES)}", file=sys.stderr)
        return 2
    config = FleetBenchConfig(workers=args.workers, batch=args.batch, step_cost=args.step_cost,
                              time_scale=args.time_scale, seed=args.seed,
                              predictor_url=args.predictor_url)
    rows = compare(trace, policies, config)
    print(f"trace {args.trace}: {len(trace)} requests, G={args.workers}, B={args.batch}, "
          f"backlog (closed loop of G*B + 4G), step cost {args.step_cost[0]:g}*max_load + "
          f"{args.step_cost[1]:g} s; proxy columns from the emulator's step log")
    print(format_rows(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def cmd_bench_proxy_overhead(args: argparse.Namespace) -> int:
    from router_client.traces import load_trace

    from .fleetbench import FleetBenchConfig, format_overhead, overhead

    trace = load_trace(args.trace, args.format, args.requests)
    config = FleetBenchConfig(workers=1, batch=args.batch, step_cost=args.step_cost,
                              time_scale=args.time_scale, seed=args.seed)
    result = overhead(trace, args.rate, config)
    print(f"trace {args.trace}: {len(trace)} requests at {args.rate:g}/s against one emulated "
          f"rank (B={args.batch}), directly and through the proxy")
    print(format_overhead(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["direct"]["failed"] == 0 and result["proxy"]["failed"] == 0 else 1
