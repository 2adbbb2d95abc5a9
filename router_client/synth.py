"""Seeded synthetic workloads, for what the bundled real traces lack.

``synth:NAME[:key=value,...]``; every workload takes ``n`` (requests) and ``seed``. Arrivals
are a Poisson process at 1 request per second (replay rescales them with ``--load``). Outputs
above ``max_output`` are cut there and marked censored, like a max_tokens cap.

long       decode-heavy, like the paper's traces: prompts lognormal with mean ``prompt_mean``
           (3200) and shape ``prompt_sigma`` (0.8); outputs lognormal with mean
           ``output_mean`` (1185) and shape ``output_sigma`` (1.0: heavy-tailed);
           ``max_output`` 16384; ``n`` 10000.
templated  ``templates`` (32) prompt templates, each with its own output distribution
           (lognormal, template medians spread with ``spread`` 1.0 around ``output_mean``
           400, within-template shape ``output_sigma`` 0.25) and prompt length; the prompt
           key is the template, so ExactMatch has something to learn; ``max_output`` 4096;
           ``n`` 10000.
shift      the output distribution changes part-way: lognormal mean ``before_mean`` (300)
           until fraction ``shift_at`` (0.5) of the requests, then ``after_mean`` (1200), shape
           ``output_sigma`` 0.6; prompts as ``long`` with mean 1000; ``max_output`` 8192;
           ``n`` 20000. For drift tests.

``n`` is the workload's size when nothing else asks; ``--requests N`` (``load_trace(spec,
requests=N)``) of a spec that leaves ``n`` out synthesizes N requests (more than the default
too; before 2026-12-03 the default capped them), of one that sets ``n`` min(N, n) of them.
The draws depend on the count: the first N requests of a larger workload are not the
N-request workload.
"""

from __future__ import annotations

import numpy as np

from .errors import TraceError
from .traces import Trace

DEFAULTS: dict[str, dict[str, float]] = {
    "long": {"n": 10000, "seed": 0, "prompt_mean": 3200, "prompt_sigma": 0.8,
             "output_mean": 1185, "output_sigma": 1.0, "max_output": 16384},
    "templated": {"n": 10000, "seed": 0, "templates": 32, "output_mean": 400, "spread": 1.0,
                  "output_sigma": 0.25, "prompt_mean": 1500, "max_output": 4096},
    "shift": {"n": 20000, "seed": 0, "before_mean": 300, "after_mean": 1200, "shift_at": 0.5,
              "output_sigma": 0.6, "prompt_mean": 1000, "prompt_sigma": 0.8, "max_output": 8192},
}
INTEGER_PARAMS = {"n", "seed", "templates", "max_output"}


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``synth:NAME[:k=v,...]`` -> (name, parameters with defaults filled in)."""
    name, params, _ = _parse(spec)
    return name, params


def _parse(spec: str) -> tuple[str, dict[str, float], set[str]]:
    """:func:`parse_spec`, and the parameters the spec sets itself (not left to defaults)."""
    given: set[str] = set()
    parts = spec.split(":", 2)
    name = parts[1] if len(parts) > 1 else ""
    if name not in DEFAULTS:
        raise TraceError(spec, f"unknown synthetic workload {name!r}; known: {', '.join(DEFAULTS)}")
    params = dict(DEFAULTS[name])
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in params:
                raise TraceError(
                    spec, f"bad parameter {item!r}; {name} takes {', '.join(sorted(params))}"
                )
            try:
                value = float(raw)
            except ValueError:
                raise TraceError(spec, f"parameter {key} must be a number, got {raw!r}") from None
            if key in INTEGER_PARAMS and value != int(value):
                raise TraceError(spec, f"parameter {key} must be an integer, got {raw!r}")
            params[key] = value
            given.add(key)
    if params["n"] < 1:
        raise TraceError(spec, "parameter n must be >= 1")
    return name, params, given


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2.0
    return rng.lognormal(mu, sigma, size)


def synthesize(spec: str, requests: int | None = None) -> Trace:
    name, params, given = _parse(spec)
    n = int(params["n"])
    if requests is not None:
        if requests < 1:
            raise TraceError(spec, "--requests must be at least 1")
        # N requests asked of a workload whose n is left to its default: N of them (the
        # default does not cap them); of one that gives n: at most n
        n = min(n, requests) if "n" in given else requests
    rng = np.random.default_rng(int(params["seed"]))
    arrivals = np.cumsum(rng.exponential(1.0, n))
    keys: list[str | None] = [None] * n
    if name == "long":
        prompts = _lognormal(rng, params["prompt_mean"], params["prompt_sigma"], n)
        outputs = _lognormal(rng, params["output_mean"], params["output_sigma"], n)
    elif name == "templated":
        k = int(params["templates"])
        medians = _lognormal(rng, params["output_mean"], params["spread"], k)
        template_prompts = _lognormal(rng, params["prompt_mean"], 0.6, k)
        template = rng.integers(0, k, n)
        outputs = medians[template] * rng.lognormal(0.0, params["output_sigma"], n)
        prompts = template_prompts[template] * rng.lognormal(0.0, 0.1, n)
        keys = [f"template-{t:03d}" for t in template]
    else:
        prompts = _lognormal(rng, params["prompt_mean"], params["prompt_sigma"], n)
        cut = int(round(params["shift_at"] * n))
        outputs = np.concatenate([
            _lognormal(rng, params["before_mean"], params["output_sigma"], cut),
            _lognormal(rng, params["after_mean"], params["output_sigma"], n - cut),
        ])
    cap = int(params["max_output"])
    outputs = np.maximum(1, np.round(outputs)).astype(np.int64)
    censored = outputs >= cap
    outputs = np.minimum(outputs, cap)
    prompts = np.maximum(1, np.round(prompts)).astype(np.int64)
    return Trace(spec, prompts, outputs, censored, keys, arrivals - arrivals[0])
