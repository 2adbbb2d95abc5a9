"""Trace loaders: every format ``balanceroute ab --format`` takes, read as the public files are.

A :class:`Trace` holds one row per request in arrival order. Loaders report a malformed line
with :class:`~router_client.errors.TraceFormatError` (file and line number), never a traceback.

Formats (``--format auto`` detects them from the path and the first line):
  azure     CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (2023 and 2024: a UTC offset is
            applied); rows with 0 generated tokens are left out; outputs of exactly 1000
            tokens are the trace's max_tokens cap and are marked right-censored.
  mooncake  JSON lines ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
            timestamps are quantized (about 3 s), so requests that share one are spread evenly
            over the gap to the next; outputs of exactly 2000 are censored; the prompt key is
            the conversation: the xxh3_64 of the first two ``hash_ids`` (block 0 is a system
            prompt shared by all; block 1 starts the conversation, and later turns extend it);
            records with ``output_length`` 0 are left out.
  sharegpt  CSV ``num_prefill_tokens,num_decode_tokens,...``, no times (arrivals are generated
            when replaying); outputs of 1024 are censored; rows with 0 decode tokens are left
            out.
  burstgpt  CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
            (seconds); failed requests (0 response tokens) are left out; requests sharing a
            second are spread over the gap to the next.
  csv       ``arrival_s,prompt_tokens,output_tokens[,prompt_key][,finish_reason]``.
  synth:... seeded synthetic workloads, see :mod:`router_client.synth`.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import xxhash

from .errors import ParameterError, TraceError, TraceFormatError

FORMATS = ("auto", "azure", "mooncake", "sharegpt", "burstgpt", "csv")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_TRACE_TOKENS = 2**40  # far beyond any real request; keeps int64 arithmetic exact
AZURE_CAP = 1000
MOONCAKE_CAP = 2000
SHAREGPT_CAP = 1024


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order.

    ``arrival_s`` is ``None`` for traces without times (arrivals are generated on replay).
    ``censored[i]`` marks outputs cut by a cap or cancelled: the request ran for
    ``output_tokens[i]`` tokens, but its natural length is unknown (at least that).
    """

    name: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    censored: np.ndarray
    prompt_keys: list[str | None]
    arrival_s: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def head(self, n: int | None) -> Trace:
        """The first ``n`` requests (all if ``n`` is None)."""
        if n is None or n >= len(self):
            return self
        if n < 1:
            raise TraceError(self.name, "--requests must be at least 1")
        return Trace(
            self.name,
            self.prompt_tokens[:n],
            self.output_tokens[:n],
            self.censored[:n],
            self.prompt_keys[:n],
            None if self.arrival_s is None else self.arrival_s[:n],
        )


    def sample(self, n: int, seed: int = 0) -> Trace:
        """``n`` requests drawn without replacement (seeded), kept in trace order."""
        if n < 1:
            raise TraceError(self.name, "--sample must be at least 1")
        if n >= len(self):
            return self
        rows = np.sort(np.random.default_rng(seed).choice(len(self), size=n, replace=False))
        return self.take(rows)

    def draw(self, n: int, seed: int = 0) -> Trace:
        """``n`` requests drawn at random as the BF-IO simulator draws them (its
        ``request_generator``): without replacement when the trace holds at least ``n``,
        with replacement otherwise, in the order drawn, without arrival times (its setting
        has every request waiting at time 0). So ``--peer --sample 20000`` on Mooncake's
        12,031 requests replays 20,000, as the peer's published runs do."""
        if n < 1:
            raise TraceError(self.name, "--sample must be at least 1")
        rows = np.random.default_rng(seed).choice(len(self), size=n, replace=n > len(self))
        return replace(self.take(rows), arrival_s=None)

    def tile(self, n: int) -> Trace:
        """``n`` requests: the trace replayed back to back as often as needed, cut at ``n``
        (the first ``n`` when it is long enough). Each copy's arrivals follow the previous
        copy's last one by the trace's mean gap, keeping their burst shape, so a fixed load
        per worker can be kept at any fleet size (a G sweep) on a file trace."""
        if n < 1:
            raise TraceError(self.name, "tile needs at least 1 request")
        if n <= len(self):
            return self.head(n)
        copies = -(-n // len(self))
        rows = np.tile(np.arange(len(self)), copies)[:n]
        tiled = self.take(rows)
        if self.arrival_s is None:
            return tiled
        first, last = float(self.arrival_s[0]), float(self.arrival_s[-1])
        period = (last - first) * len(self) / max(len(self) - 1, 1)  # the span and one gap
        shift = np.repeat(np.arange(copies) * period, len(self))[:n]
        return replace(tiled, arrival_s=tiled.arrival_s + shift)

    def split(self, n: int, what: str) -> tuple[Trace, Trace]:
        """The first ``n`` requests (the past) and the rest (the traffic after it, arrival
        times as they were: a replay shifts them to 0). ``what`` names the setting in the
        error when either part would be empty."""
        problem = self.split_problem(n)
        if problem is not None:
            raise ParameterError(what, problem)
        return self.head(n), self.take(np.arange(n, len(self)))

    def split_problem(self, n: int) -> str | None:
        """Why :meth:`split` at ``n`` would leave a part empty, else None (a check that does
        not copy the arrays)."""
        if n < 1 or n >= len(self):
            return (f"{n}: must be at least 1 and below the {len(self)} requests it splits "
                    f"({self.name}; some must be left to replay)")
        return None

    def take(self, rows: np.ndarray) -> Trace:
        """The requests at ``rows`` (in that order)."""
        return Trace(self.name, self.prompt_tokens[rows], self.output_tokens[rows],
                     self.censored[rows], [self.prompt_keys[i] for i in rows.tolist()],
                     None if self.arrival_s is None else self.arrival_s[rows])


def key_of_text(text: str) -> str:
    """Prompt key of a text: xxh3_64 hex, as the service derives it."""
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


def _int_field(source: str, line: int, name: str, raw: object, minimum: int) -> int:
    try:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ValueError
        value = int(raw)
        if isinstance(raw, float) and raw != value:
            raise ValueError
    except (TypeError, ValueError):
        raise TraceFormatError(source, line, f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise TraceFormatError(source, line, f"{name} must be >= {minimum}, got {value}")
    if value > MAX_TRACE_TOKENS:
        raise TraceFormatError(source, line,
                               f"{name} must be <= {MAX_TRACE_TOKENS}, got {value}")
    return value


def _seconds_field(source: str, line: int, name: str, raw: str) -> float:
    """A time in seconds: a finite number >= 0."""
    try:
        value = float(raw)
        if not math.isfinite(value) or value < 0:
            raise ValueError
    except ValueError:
        raise TraceFormatError(source, line, f"{name} must be a number >= 0, got {raw!r}") from None
    return value


def _build(
    name: str,
    prompts: list[int],
    outputs: list[int],
    censored: list[bool],
    keys: list[str | None],
    arrivals: list[float] | None,
) -> Trace:
    if not prompts:
        raise TraceError(name, "the trace has no requests (records with no output token are "
                               "left out: nothing to decode)")
    arrival = None
    if arrivals is not None:
        arrival = np.asarray(arrivals, dtype=np.float64)
        arrival = arrival - arrival[0]
    return Trace(
        name,
        np.asarray(prompts, dtype=np.int64),
        np.asarray(outputs, dtype=np.int64),
        np.asarray(censored, dtype=bool),
        keys,
        arrival,
    )


def _csv_rows(source: str, text: str, expected: list[str]
              ) -> tuple[list[str], Iterator[list[str]]]:
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceError(source, "the file is empty") from None
    missing = [c for c in expected if c not in header]
    if missing:
        raise TraceFormatError(
            source, 1, f"header lacks column(s) {', '.join(missing)}; got {','.join(header)}"
        )
    return header, reader


def _row(source: str, line: int, header: list[str], values: list[str]) -> dict[str, str]:
    if len(values) != len(header):
        raise TraceFormatError(
            source, line, f"expected {len(header)} fields, got {len(values)}: {','.join(values)}"
        )
    return dict(zip(header, (v.strip() for v in values), strict=True))


_UTC_OFFSET = re.compile(r"(?:Z|([+-])(\d{2}):?(\d{2}))$")


def _timestamp_s(source: str, line: int, raw: str) -> float:
    """Seconds since the epoch of an ISO date-time (a space or ``T`` between date and time),
    as the Azure traces write it: ``2023-11-16 18:17:03.9799600`` (2023, no zone) or
    ``2024-05-10 00:00:00.009930+00:00`` (2024, with a UTC offset, which is applied)."""
    date, sep, time_of_day = raw.replace("T", " ", 1).partition(" ")
    offset_s = 0
    match = _UTC_OFFSET.search(time_of_day) if sep else None
    if match:
        time_of_day = time_of_day[:match.start()]
        if match.group(1):
            sign = -1 if match.group(1) == "-" else 1
            offset_s = sign * (int(match.group(2)) * 3600 + int(match.group(3)) * 60)
    try:
        if any(c in time_of_day for c in "+-Zz"):  # a zone that is not an offset
            raise ValueError
        stamp = np.datetime64(f"{date}T{time_of_day}" if sep else date, "ns")
    except ValueError:
        raise TraceFormatError(source, line, f"TIMESTAMP is not a date-time: {raw!r}") from None
    return float(stamp.astype(np.int64)) / 1e9 - offset_s


def load_azure(source: str, text: str) -> Trace:
    """Azure LLM inference traces (2023 and 2024). A row with no generated token never
    reaches a decode worker and is left out; outputs at ``AZURE_CAP`` are censored."""
    header, reader = _csv_rows(source, text, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    prompts: list[int] = []
    outputs: list[int] = []
    arrivals: list[float] = []
    for line, values in enumerate(reader, start=2):
        if not values:
            continue
        row = _row(source, line, header, values)
        arrivals.append(_timestamp_s(source, line, row["TIMESTAMP"]))
        prompts.append(_int_field(source, line, "ContextTokens", row["ContextTokens"], 0))
        outputs.append(_int_field(source, line, "GeneratedTokens", row["GeneratedTokens"], 0))
    _check_sorted(source, arrivals)
    kept = [i for i, output in enumerate(outputs) if output > 0]  # 0: nothing to decode
    if len(kept) < len(outputs):
        prompts, outputs = [prompts[i] for i in kept], [outputs[i] for i in kept]
        arrivals = [arrivals[i] for i in kept]
    return _build(source, prompts, outputs, [o == AZURE_CAP for o in outputs],
                  [None] * len(prompts), arrivals)


def load_mooncake(source: str, text: str) -> Trace:
    prompts: list[int] = []
    outputs: list[int] = []
    stamps: list[float] = []
    keys: list[str | None] = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(source, line, f"not valid JSON ({exc.msg})") from None
        except RecursionError:  # arrays or objects nested past the parser's depth
            raise TraceFormatError(source, line, "not valid JSON (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(source, line, "expected a JSON object")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in obj:
                raise TraceFormatError(source, line, f"missing field {field!r}")
        stamp = obj["timestamp"]
        is_number = isinstance(stamp, int | float) and not isinstance(stamp, bool)
        if not is_number or not math.isfinite(stamp):
            raise TraceFormatError(source, line, f"timestamp must be a number, got {stamp!r}")
        prompt = _int_field(source, line, "input_length", obj["input_length"], 0)
        output = _int_field(source, line, "output_length", obj["output_length"], 0)
        hash_ids = obj.get("hash_ids")
        _check_hash_ids(source, line, hash_ids)  # a left-out record's too
        if output == 0:  # nothing to decode: never reaches a decode worker
            continue
        stamps.append(float(stamp) / 1000.0)
        prompts.append(prompt)
        outputs.append(output)
        keys.append(xxhash.xxh3_64_hexdigest(repr(hash_ids[:2]).encode()) if hash_ids else None)
    _check_sorted(source, stamps)
    return _build(source, prompts, outputs, [o == MOONCAKE_CAP for o in outputs], keys,
                  spread_quantized(stamps))


def _check_hash_ids(source: str, line: int, hash_ids: object) -> None:
    """``hash_ids`` is absent (None) or a list of integers (else a TraceFormatError)."""
    if hash_ids is not None and not (isinstance(hash_ids, list) and all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids)):
        raise TraceFormatError(source, line, "hash_ids must be a list of integers")


def spread_quantized(stamps: list[float]) -> list[float]:
    """Spread requests that share a quantized timestamp evenly over the gap to the next one.

    The gap used for the last group is the median gap between distinct timestamps.
    """
    values = np.asarray(stamps, dtype=np.float64)
    distinct, starts, counts = np.unique(values, return_index=True, return_counts=True)
    if distinct.size < 2:
        return list(values)
    gaps = np.diff(distinct)
    gaps = np.append(gaps, np.median(gaps))
    out = values.copy()
    for start, count, gap in zip(starts, counts, gaps, strict=True):
        out[start : start + count] += gap * np.arange(count) / count
    return list(out)


def load_sharegpt(source: str, text: str) -> Trace:
    header, reader = _csv_rows(source, text, ["num_prefill_tokens", "num_decode_tokens"])
    prompts: list[int] = []
    outputs: list[int] = []
    for line, values in enumerate(reader, start=2):
        if not values:
            continue
        row = _row(source, line, header, values)
        prompt = _int_field(source, line, "num_prefill_tokens", row["num_prefill_tokens"], 0)
        output = _int_field(source, line, "num_decode_tokens", row["num_decode_tokens"], 0)
        if output == 0:
            continue  # nothing to decode
        prompts.append(prompt)
        outputs.append(output)
    return _build(source, prompts, outputs, [o == SHAREGPT_CAP for o in outputs],
                  [None] * len(prompts), None)


BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def load_burstgpt(source: str, text: str) -> Trace:
    """BurstGPT (``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``):
    ``Timestamp`` in seconds from the trace's start. Its failed requests (``Response tokens``
    0, as the trace's README describes them) never reach a decode worker and are left out.
    Requests that share a timestamp are spread over the gap to the next one, as Mooncake's.
    No prompt key (the model and log type name a service, not a prompt); no cap is known, so
    nothing is censored."""
    header, reader = _csv_rows(source, text, list(BURSTGPT_COLUMNS))
    prompts: list[int] = []
    outputs: list[int] = []
    stamps: list[float] = []
    for line, values in enumerate(reader, start=2):
        if not values:
            continue
        row = _row(source, line, header, values)
        output = _int_field(source, line, "Response tokens", row["Response tokens"], 0)
        prompt = _int_field(source, line, "Request tokens", row["Request tokens"], 0)
        stamp = _seconds_field(source, line, "Timestamp", row["Timestamp"])
        if stamps and stamp < stamps[-1]:
            raise TraceFormatError(source, line, "arrival times go backwards")
        if output == 0:
            continue  # a failed request: no decode
        stamps.append(stamp)
        prompts.append(prompt)
        outputs.append(output)
    return _build(source, prompts, outputs, [False] * len(outputs), [None] * len(prompts),
                  spread_quantized(stamps) if stamps else None)


def load_generic_csv(source: str, text: str) -> Trace:
    header, reader = _csv_rows(source, text, ["arrival_s", "prompt_tokens", "output_tokens"])
    prompts: list[int] = []
    outputs: list[int] = []
    arrivals: list[float] = []
    censored: list[bool] = []
    keys: list[str | None] = []
    for line, values in enumerate(reader, start=2):
        if not values:
            continue
        row = _row(source, line, header, values)
        arrivals.append(_seconds_field(source, line, "arrival_s", row["arrival_s"]))
        prompts.append(_int_field(source, line, "prompt_tokens", row["prompt_tokens"], 0))
        outputs.append(_int_field(source, line, "output_tokens", row["output_tokens"], 1))
        keys.append(row.get("prompt_key") or None)
        reason = row.get("finish_reason") or "stop"
        if reason not in FINISH_REASONS:
            raise TraceFormatError(
                source, line,
                f"finish_reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}",
            )
        censored.append(reason != "stop")
    _check_sorted(source, arrivals)
    return _build(source, prompts, outputs, censored, keys, arrivals)


def _check_sorted(source: str, arrivals: list[float]) -> None:
    for index in range(1, len(arrivals)):
        if arrivals[index] < arrivals[index - 1]:
            raise TraceFormatError(source, index + 2, "arrival times go backwards")


LOADERS = {
    "azure": load_azure,
    "mooncake": load_mooncake,
    "sharegpt": load_sharegpt,
    "burstgpt": load_burstgpt,
    "csv": load_generic_csv,
}


def detect_format(source: str, text: str) -> str:
    """Guess the format from the first non-empty line."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first:
        raise TraceError(source, "the file is empty")
    if first.lstrip().startswith("{"):
        return "mooncake"
    columns = [c.strip() for c in first.split(",")]
    if columns[:3] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        return "azure"
    if "num_prefill_tokens" in columns and "num_decode_tokens" in columns:
        return "sharegpt"
    if all(c in columns for c in BURSTGPT_COLUMNS):
        return "burstgpt"
    if "arrival_s" in columns:
        return "csv"
    raise TraceError(
        source,
        "cannot tell the format from the first line "
        f"({first[:80]!r}); pass --format azure|mooncake|sharegpt|burstgpt|csv",
    )


def parse_trace(text: str, fmt: str = "auto", source: str = "<trace>") -> Trace:
    """Parse trace text of a given format (``auto`` detects it)."""
    if fmt not in FORMATS:
        raise TraceError(source, f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(source, text)
    return LOADERS[fmt](source, text)


def load_trace(spec: str, fmt: str = "auto", requests: int | None = None) -> Trace:
    """Load a trace file or a ``synth:NAME[:k=v,...]`` workload, keeping the first N."""
    if spec.startswith("synth:"):
        from .synth import synthesize

        return synthesize(spec, requests)
    path = Path(spec)
    if fmt not in FORMATS:
        raise TraceError(spec, f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if requests is not None and requests < 1:
        raise TraceError(spec, "--requests must be at least 1")
    try:
        if requests is None:
            text = path.read_text(encoding="utf-8")
        else:
            text, fmt = _read_head(path, spec, fmt, requests)
    except FileNotFoundError:
        raise TraceError(spec, "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(spec, f"cannot read the file ({exc})") from None
    return parse_trace(text, fmt, spec).head(requests)


def parse_trace_head(text: str, fmt: str, source: str, requests: int) -> Trace:
    """``parse_trace(text, fmt, source).head(requests)``, without parsing the rows past
    the first ``requests`` requests (an uploaded trace of millions of rows)."""
    if fmt not in FORMATS:
        raise TraceError(source, f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    text, fmt = _head_of(io.StringIO(text, newline=None), source, fmt, requests)
    return parse_trace(text, fmt, source).head(requests)


def _read_head(path: Path, spec: str, fmt: str, requests: int) -> tuple[str, str]:
    """The start of the file that holds its first ``requests`` requests, and its format: a
    file of millions of rows is not read (nor parsed) past what ``--requests`` keeps. What
    the rows become is the same as from the whole file (read with the same universal
    newlines, CSV records counted as the parser counts them, quoted fields included): a
    Mooncake or BurstGPT trace is read on to the first request of a later timestamp, so the
    last kept requests' shared timestamp is spread over the same gap with the same count
    (:func:`spread_quantized`), and the rows the loaders leave out (Azure's 0-token rows,
    BurstGPT's failed requests) are not counted."""
    with path.open(encoding="utf-8") as stream:
        return _head_of(stream, spec, fmt, requests)


def _head_of(stream: Iterable[str], spec: str, fmt: str, requests: int) -> tuple[str, str]:
    """:func:`_read_head` of lines from ``stream`` (universal newlines already applied)."""
    lines: list[str] = []
    feed = _recorded(stream, lines)
    first = next((line for line in feed if line.strip()), None)
    if first is None:
        return "".join(lines), fmt  # empty: the parser says so
    fmt = detect_format(spec, first) if fmt == "auto" else fmt
    if fmt == "mooncake":
        _read_requests(itertools.chain([first], feed), _mooncake_request, requests)
    else:
        header = [c.strip() for c in next(csv.reader([first]))]
        _read_requests(csv.reader(feed), partial(_csv_request, fmt, header), requests)
    return "".join(lines), fmt


def _recorded(stream: Iterable[str], lines: list[str]) -> Iterator[str]:
    for line in stream:
        lines.append(line)
        yield line


def _read_requests(records: Iterable, request: Callable[[object], tuple[bool, object]],
                   wanted: int) -> None:
    """Consume ``records`` until ``wanted`` requests are read and, where requests carry a
    shared timestamp, the last one's timestamp is over (a record of a later one read).
    ``request(record)`` tells whether the record is a request and its timestamp (None: no
    timestamp to keep together)."""
    count, last = 0, None
    for record in records:
        counted, stamp = request(record)
        if not counted:
            continue
        count += 1
        if count == wanted:
            last = stamp
            if stamp is None:
                return
        elif count > wanted and stamp != last:
            return


def _mooncake_request(line: object) -> tuple[bool, object]:
    text = str(line)
    if not text.strip():
        return False, None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return True, _UNREADABLE  # the full parse names the problem
    if not isinstance(obj, dict):
        return True, _UNREADABLE
    if _is_zero(obj.get("output_length")):
        return False, None  # left out, as the full parse leaves it out
    stamp = obj.get("timestamp")
    return True, _UNREADABLE if stamp is None else stamp


def _csv_request(fmt: str, header: list[str], values: object) -> tuple[bool, object]:
    """Whether a CSV record is a request the loader keeps, and its timestamp where requests
    sharing one are spread (BurstGPT)."""
    if not values:
        return False, None
    row = dict(zip(header, (str(v).strip() for v in values), strict=False))  # type: ignore
    if fmt == "azure":
        return not _is_zero(row.get("GeneratedTokens")), None
    if fmt == "sharegpt":
        return not _is_zero(row.get("num_decode_tokens")), None
    if fmt == "burstgpt":
        if _is_zero(row.get("Response tokens")):
            return False, None
        try:
            return True, float(row.get("Timestamp", ""))
        except ValueError:
            return True, _UNREADABLE
    return True, None


_UNREADABLE = object()  # a record the quick read cannot place: never equal to a timestamp


def _is_zero(value: object) -> bool:
    """A count of 0 as :func:`_int_field` reads it (``0``, ``0.0``, ``"00"``; not ``False``
    nor ``"0.0"``, which it refuses): a row the loaders leave out."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == 0
    try:
        return isinstance(value, str) and int(value) == 0
    except ValueError:
        return False
