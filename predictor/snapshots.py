"""What a restart needs of the observations it does not replay, and its snapshots.

A restart replays the newest ``REPLAY_OBSERVATIONS`` in full (``PredictorService._replay``);
of the older ones only the per-key state matters: each prompt key's newest outcomes and the
length bins of its newest ended ones (ExactMatch's buckets), each key's all-time count, ended
count and sum of ``ln(1 + output)`` (the hazard model's key statistics), the global ended
count and sum, and where ExactMatch's schedule of estimates of ``k`` stands.

:func:`advance` computes that :class:`KeyState` from the state as of an observation id and the
stored rows after it (up to the end of a batch), in one vectorized pass. It gives what the
live learners get by learning the same rows batch by batch: the same outcomes and bins per
key, the keys in the same order (least recently updated first), the sums bit for bit (they
are added in the same order), the same point in the refresh schedule, as long as no key was
evicted on the way (past ``EXACT_MATCH_MAX_BUCKETS`` or ``EXACT_MATCH_MAX_BYTES`` the keys
kept are the most recently updated that fit, each with its newest outcomes).

A snapshot is a :class:`KeyState` written to the database (table ``learner_snapshots``),
tagged with the newest observation id it covers, the format and the parameters that shape it.
A running service writes one on a background thread every ``SNAPSHOT_EVERY`` observations
(:func:`write_snapshot`); a restart reads the newest usable one and advances it over the rows
since (:func:`restore`), so its cost does not grow with the stored count. A snapshot that
cannot be read (another format, other parameters, damaged) is passed over with a warning: the
restart falls back to an older one, or to the scan of every older row (:func:`advance` from
the empty state), with the same result.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from . import store
from .estimators.exact_match import (
    BINS_KEPT,
    BUCKET_OVERHEAD,
    KEYS_USED,
    REFRESH_EVERY,
    estimate_prior_weight,
    length_bin,
)
from .settings import Settings

SNAPSHOT_FORMAT = 1  # the layout :func:`encode` writes; others are not read
SNAPSHOTS_KEPT = 2  # the newest snapshots kept in the database (the previous one: a fallback)

log = logging.getLogger("balanceroute.snapshots")


class SnapshotError(ValueError):
    """A stored snapshot this version cannot use."""


@dataclass(frozen=True)
class KeyParams:
    """The settings that shape a :class:`KeyState`; a snapshot made under others is not
    used."""

    bucket_window: int
    max_buckets: int
    max_bytes: int
    max_keys: int
    refresh_every: int
    estimate_weight: bool

    @classmethod
    def of(cls, settings: Settings) -> KeyParams:
        return cls(settings.exact_match_bucket_window, settings.exact_match_max_buckets,
                   settings.exact_match_max_bytes, settings.exact_match_max_buckets,
                   REFRESH_EVERY, settings.exact_match_estimate_weight)

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _ints(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass
class KeyState:
    """The per-key state of the observations up to ``upto_id`` (see the module).

    ``keys`` holds every key the two parts refer to (by index). ExactMatch's part: its keys
    (``bucket_key``, least recently updated first), each key's newest outcomes
    (``bucket_len`` of them in ``durations`` and ``events``, oldest first, key after key) and
    its newest ended length bins (``bins_len`` of them in ``bins``). The hazard model's part:
    its keys (``stat_key``, least recently updated first) with (count, ended, sum of
    ``ln(1 + output)`` over the ended) in ``stats``; ``ended`` and ``total`` over every
    observation, with or without a key."""

    upto_id: int = 0
    observations: int = 0
    since_refresh: int = 0
    ended: int = 0
    total: float = 0.0
    prior_weight: float | None = None  # ExactMatch's k at its last estimate (None: none)
    keys: list[str] = field(default_factory=list)
    bucket_key: np.ndarray = field(default_factory=_ints)
    bucket_len: np.ndarray = field(default_factory=_ints)
    durations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    events: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    bins_len: np.ndarray = field(default_factory=_ints)
    bins: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    stat_key: np.ndarray = field(default_factory=_ints)
    stats: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))

    def buckets(self) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        """ExactMatch's keys, least recently updated first, with their outcomes and bins."""
        if self.bucket_key.size == 0:
            return []
        durations = np.split(self.durations, np.cumsum(self.bucket_len)[:-1])
        events = np.split(self.events, np.cumsum(self.bucket_len)[:-1])
        bins = np.split(self.bins, np.cumsum(self.bins_len)[:-1])
        return [(self.keys[k], d.copy(), e.copy(), b.copy()) for k, d, e, b in
                zip(self.bucket_key.tolist(), durations, events, bins, strict=True)]

    def key_statistics(self) -> list[tuple[str, list[float]]]:
        """The hazard model's keys, least recently updated first, with their sums."""
        return [(self.keys[k], row) for k, row in
                zip(self.stat_key.tolist(), self.stats.tolist(), strict=True)]


@dataclass(frozen=True)
class Rows:
    """Stored observations in id order, as columns: ``code`` indexes ``keys`` (-1: no key)."""

    ids: np.ndarray
    batch: np.ndarray
    code: np.ndarray
    output: np.ndarray
    censored: np.ndarray
    keys: list[str]


def read_rows(session: Session, state: KeyState, upto_id: int) -> Rows:
    """The observations after ``state.upto_id`` up to ``upto_id``, coded by
    :func:`code_rows`."""
    return code_rows(store.keyed_rows(session=session, after_id=state.upto_id,
                                      upto_id=upto_id), state)


def code_rows(chunks: Iterable[Sequence], state: KeyState) -> Rows:
    """Rows (id, batch, prompt_key, output_tokens, censored) in id order as :class:`Rows`,
    their keys coded against ``state.keys`` (new keys appended)."""
    index: dict[str | None, int] = {key: i for i, key in enumerate(state.keys)}
    index[None] = -1  # no key
    parts: list[list[np.ndarray]] = [[], [], [], [], []]
    for rows in chunks:
        n = len(rows)
        keys = [r[2] for r in rows]
        for key in dict.fromkeys(keys):
            if key not in index:
                index[key] = len(index) - 1
        parts[0].append(np.fromiter([r[0] for r in rows], np.int64, n))
        parts[1].append(np.fromiter([r[1] for r in rows], np.int64, n))
        parts[2].append(np.fromiter(map(index.__getitem__, keys), np.int64, n))
        parts[3].append(np.fromiter([r[3] for r in rows], np.int64, n))
        parts[4].append(np.fromiter([r[4] for r in rows], bool, n))
    ids, batch, code, output, censored = (np.concatenate(p) if p else _ints() for p in parts)
    return Rows(ids, batch, code, output, censored.astype(bool),
                [key for key in index if key is not None])


def advance(state: KeyState, rows: Rows, params: KeyParams) -> KeyState:
    """The state after learning ``rows`` (the observations after ``state.upto_id``, coded by
    :func:`read_rows`), as the live learners would, batch by batch (see the module). Where
    the last estimate of ExactMatch's ``k`` fell due among them, it is made from the keys as
    they were then."""
    if rows.ids.size == 0:
        return state
    starts = np.flatnonzero(np.concatenate([[True], rows.batch[1:] != rows.batch[:-1]]))
    sizes = np.diff(np.append(starts, rows.ids.size))  # batch after batch, as learned
    since, due = _refresh_phase(state.since_refresh, sizes, params)
    if due >= 0:  # up to the end of that batch, estimate k, then the rest
        cut = int(starts[due] + sizes[due])
        state = _advance(state, rows, slice(0, cut), 0, params)
        state.prior_weight = _estimate_k(state)
        rows = replace(rows, **{name: getattr(rows, name)[cut:] for name in _COLUMNS})
        if rows.ids.size == 0:
            return _compact(state)
    return _compact(_advance(state, rows, slice(None), since, params))


_COLUMNS = ("ids", "batch", "code", "output", "censored")


def _advance(state: KeyState, rows: Rows, part: slice, since_refresh: int,
             params: KeyParams) -> KeyState:
    ids, code, ended = rows.ids[part], rows.code[part], ~rows.censored[part]
    batch, output = rows.batch[part], rows.output[part]
    segment = np.cumsum(np.concatenate([[0], batch[1:] != batch[:-1]]))
    logs = np.log1p(output.astype(np.float64))
    new = replace(
        state, upto_id=int(ids[-1]), observations=state.observations + int(ids.size),
        since_refresh=since_refresh, ended=state.ended + int(ended.sum()),
        # sequential sums, as the live learner adds one observation after another
        total=float(np.cumsum(np.concatenate([[state.total], logs[ended]]))[-1]),
        keys=rows.keys)
    n_keys, keyed = len(rows.keys), code >= 0
    code, output, events = code[keyed], output[keyed], ended[keyed]
    _advance_stats(new, state, code, events, logs[keyed], n_keys, params)
    _advance_buckets(new, state, code, output, events, segment[keyed], n_keys,
                     params)
    return new


def _refresh_phase(since: int, sizes: np.ndarray, params: KeyParams) -> tuple[int, int]:
    """ExactMatch's count of observations since its last estimate of ``k`` after batches of
    ``sizes`` (its ``learn_keys``), and the batch after which the last estimate fell due (-1:
    none)."""
    every, estimate, due = params.refresh_every, params.estimate_weight, -1
    for index, size in enumerate(sizes.tolist()):
        since += size
        if estimate and since >= every:
            since, due = 0, index
    return since, due


def _estimate_k(state: KeyState) -> float | None:
    """ExactMatch's estimate of ``k`` from the bins of its most recently updated keys."""
    bins = np.split(state.bins, np.cumsum(state.bins_len)[:-1])[-KEYS_USED:]
    return estimate_prior_weight([b.tolist() for b in bins if b.size])


def _touched_order(old: np.ndarray, code: np.ndarray, when: np.ndarray, n_keys: int
                   ) -> np.ndarray:
    """Keys least recently updated first: the ``old`` order without the keys in ``code``,
    then those by ``when`` (per key, the row position it was last moved to the end at)."""
    touched = np.zeros(n_keys, dtype=bool)
    touched[code] = True
    moved = np.flatnonzero(touched)
    return np.concatenate([old[~touched[old]], moved[np.argsort(when[moved], kind="stable")]])


def _advance_stats(new: KeyState, old: KeyState, code: np.ndarray, events: np.ndarray,
                   logs: np.ndarray, n_keys: int, params: KeyParams) -> None:
    """The hazard model's key statistics (a key moves to the end at each of its rows)."""
    current = np.zeros((n_keys, 3))
    current[old.stat_key] = old.stats
    count = current[:, 0] + np.bincount(code, minlength=n_keys)
    ends = current[:, 1] + np.bincount(code[events], minlength=n_keys)
    # bincount adds in order from 0.0: the stored sum first, then each new value in turn
    sums = np.bincount(np.concatenate([np.arange(n_keys), code[events]]),
                       weights=np.concatenate([current[:, 2], logs[events]]), minlength=n_keys)
    last = np.full(n_keys, -1, dtype=np.int64)
    np.maximum.at(last, code, np.arange(code.size))
    order = _touched_order(old.stat_key, code, last, n_keys)[-params.max_keys:]
    new.stat_key = order
    new.stats = np.column_stack([count, ends, sums])[order]


def _advance_buckets(new: KeyState, old: KeyState, code: np.ndarray, output: np.ndarray,
                     events: np.ndarray, segment: np.ndarray, n_keys: int,
                     params: KeyParams) -> None:
    """ExactMatch's buckets: a key moves to the end once per batch, at its first row in it;
    it keeps its newest ``bucket_window`` outcomes and ``BINS_KEPT`` ended bins."""
    last_segment = np.full(n_keys, -1, dtype=np.int64)
    np.maximum.at(last_segment, code, segment)
    in_last = segment == last_segment[code]
    first = np.full(n_keys, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, code[in_last], np.flatnonzero(in_last))
    order = _touched_order(old.bucket_key, code, first, n_keys)
    window = params.bucket_window
    lengths, columns = _newest_per_key(
        np.concatenate([np.repeat(old.bucket_key, old.bucket_len), code]), order, n_keys,
        window, np.concatenate([old.durations, output.astype(np.int32)]),
        np.concatenate([old.events, events]))
    bins_len, (bins,) = _newest_per_key(
        np.concatenate([np.repeat(old.bucket_key, old.bins_len), code[events]]), order,
        n_keys, min(window, BINS_KEPT),
        np.concatenate([old.bins, length_bin(output[events]).astype(np.int8)]))
    key_chars = np.fromiter((len(new.keys[k]) for k in order.tolist()), np.int64, order.size)
    nbytes = BUCKET_OVERHEAD + 5 * lengths + bins_len + key_chars  # as Bucket.nbytes counts
    # the least recently updated go first while over a bound (one key always stays)
    held = np.cumsum(nbytes[::-1])[::-1]
    fits = (held <= params.max_bytes) & (np.arange(order.size)[::-1] < params.max_buckets)
    drop = max(0, min(int(np.argmax(fits)) if fits.any() else order.size, order.size - 1))
    new.bucket_key, new.bucket_len, new.bins_len = order[drop:], lengths[drop:], bins_len[drop:]
    kept = slice(int(lengths[:drop].sum()), None)
    new.durations, new.events = columns[0][kept], columns[1][kept]
    new.bins = bins[int(bins_len[:drop].sum()):]


def _newest_per_key(code: np.ndarray, order: np.ndarray, n_keys: int, limit: int,
                    *columns: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Per key of ``order`` (in that order), its newest ``limit`` entries of ``columns``
    (entries in time order, ``code`` their keys): how many, and the columns key after key."""
    by_key = np.argsort(code, kind="stable")  # key after key, each in time order
    counts = np.bincount(code, minlength=n_keys)
    ends = np.cumsum(counts)
    kept = np.minimum(counts, limit)
    first = ends - kept  # where each key's newest entries start in key order
    lengths = kept[order]
    picks = by_key[np.repeat(first[order] - np.cumsum(lengths) + lengths, lengths)
                   + np.arange(int(lengths.sum()))]
    return lengths, tuple(column[picks] for column in columns)


def _compact(state: KeyState) -> KeyState:
    """Drop the keys neither part holds any more."""
    used = np.union1d(state.bucket_key, state.stat_key)
    if used.size == len(state.keys):
        return state
    index = np.full(len(state.keys), -1, dtype=np.int64)
    index[used] = np.arange(used.size)
    return replace(state, keys=[state.keys[k] for k in used.tolist()],
                   bucket_key=index[state.bucket_key], stat_key=index[state.stat_key])


# -- snapshots --------------------------------------------------------------------------------
_ARRAYS = ("bucket_key", "bucket_len", "durations", "events", "bins_len", "bins", "stat_key",
           "stats")
_DTYPES = (np.int64, np.int64, np.int32, bool, np.int64, np.int8, np.int64, np.float64)


def encode(state: KeyState, params: KeyParams) -> bytes:
    """A snapshot's bytes: a NumPy ``.npz`` (no pickled objects), compressed."""
    meta = {"format": SNAPSHOT_FORMAT, "params": json.loads(params.text()),
            "upto_id": state.upto_id, "observations": state.observations,
            "since_refresh": state.since_refresh, "ended": state.ended, "total": state.total,
            "prior_weight": state.prior_weight}
    encoded = [key.encode("utf-8", "surrogatepass") for key in state.keys]
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        key_bytes=np.frombuffer(b"".join(encoded), dtype=np.uint8),
        key_len=np.fromiter((len(k) for k in encoded), np.int64, len(encoded)),
        **{name: getattr(state, name) for name in _ARRAYS})
    return buffer.getvalue()


def decode(data: bytes, params: KeyParams) -> KeyState:
    """The state a snapshot holds; :class:`SnapshotError` if it is of another format, was made
    under other parameters, or does not hold together."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        meta = json.loads(arrays["meta"].tobytes())
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"format {meta.get('format')!r}, this version reads "
                                f"{SNAPSHOT_FORMAT}")
        if meta.get("params") != json.loads(params.text()):
            raise SnapshotError(f"made under {meta.get('params')}, now {params.text()}")
        raw, lengths = arrays["key_bytes"].tobytes(), arrays["key_len"].astype(np.int64)
        edges = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        keys = [raw[a:b].decode("utf-8", "surrogatepass")
                for a, b in zip(edges[:-1], edges[1:], strict=True)]
        state = KeyState(
            int(meta["upto_id"]), int(meta["observations"]), int(meta["since_refresh"]),
            int(meta["ended"]), float(meta["total"]),
            None if meta["prior_weight"] is None else float(meta["prior_weight"]),
            keys,
            **{name: arrays[name].astype(dtype, copy=False)
               for name, dtype in zip(_ARRAYS, _DTYPES, strict=True)})
        if edges[-1] != len(raw):
            raise SnapshotError("key table of the wrong size")
    except SnapshotError:
        raise
    except Exception as error:  # damaged: whatever numpy, zipfile or json raised
        raise SnapshotError(f"unreadable ({type(error).__name__}: {error})") from error
    _check(state)
    return state


def _check(state: KeyState) -> None:
    n = len(state.keys)
    sizes = (state.bucket_key.size == state.bucket_len.size == state.bins_len.size
             and int(state.bucket_len.sum()) == state.durations.size == state.events.size
             and int(state.bins_len.sum()) == state.bins.size
             and state.stats.shape == (state.stat_key.size, 3))
    indices = np.concatenate([state.bucket_key, state.stat_key])
    if not sizes or (indices.size and (indices.min() < 0 or indices.max() >= n)):
        raise SnapshotError("arrays that do not hold together")


def restore(session: Session, upto_id: int, params: KeyParams) -> tuple[KeyState, int]:
    """The state as of ``upto_id`` (the end of a batch): the newest usable snapshot at or
    before it, advanced over the rows since; returns it and the id the snapshot covered (0:
    none, every row was scanned)."""
    state = _newest_usable(session, upto_id, params)
    base = state.upto_id
    return advance(state, read_rows(session, state, upto_id), params), base


def _newest_usable(session: Session, upto_id: int, params: KeyParams) -> KeyState:
    for snapshot_id, covered, fmt in store.snapshot_index(session=session, upto_id=upto_id):
        if fmt != SNAPSHOT_FORMAT:
            log.warning("learner snapshot %d (observations up to %d) has format %s, this "
                        "version reads %d: not used", snapshot_id, covered, fmt,
                        SNAPSHOT_FORMAT)
            continue
        try:
            state = decode(store.snapshot_data(session=session, snapshot_id=snapshot_id),
                           params)
        except SnapshotError as error:
            log.warning("learner snapshot %d (observations up to %d) not used: %s",
                        snapshot_id, covered, error)
            continue
        if state.upto_id == covered:
            return state
        log.warning("learner snapshot %d says it covers %d, its row %d: not used",
                    snapshot_id, state.upto_id, covered)
    return KeyState()


def snapshot_point(session: Session, replay: int) -> int:
    """Where a restart's replay of the newest ``replay`` observations starts: the end of the
    batch before the one holding the ``replay``-th newest id (0: replay everything). A
    snapshot is taken there, so every later restart can use it."""
    newest = store.latest_observation_id(session=session)
    if replay <= 0 or newest <= replay:
        return 0
    return store.batch_start(session=session, upto_id=newest - replay)


def write_snapshot(session: Session, settings: Settings, awaited: int | None = None
                   ) -> int | None:
    """Write a snapshot of the state as of :func:`snapshot_point` if the newest one covers
    ``SNAPSHOT_EVERY`` or more fewer observations; returns the id it covers, or None (not
    due, another replica is writing one, or ``awaited``, an id that may still commit late,
    is not above it). Only the database and this function's own arrays are touched, never
    the service's learners or locks."""
    every = settings.snapshot_every
    if every <= 0 or not store.try_snapshot_lock(session=session):
        return None
    params = KeyParams.of(settings)
    upto = snapshot_point(session, settings.replay_observations)
    newest = store.newest_snapshot(session=session, fmt=SNAPSHOT_FORMAT, params=params.text())
    if upto - newest < every or (awaited is not None and awaited <= upto):
        return None
    state, _ = restore(session, upto, params)
    data = encode(state, params)
    try:
        store.insert_snapshot(session=session, upto_id=upto, fmt=SNAPSHOT_FORMAT,
                              params=params.text(), data=data, keep=SNAPSHOTS_KEPT)
        session.commit()
    except IntegrityError:  # another replica wrote the same one: as good as ours
        session.rollback()
        return None
    log.info("wrote a learner snapshot of the observations up to %d (%d bytes)", upto,
             len(data))
    return upto
