from pathlib import Path

import pytest

from router_client.sse import SSEParser, StreamTelemetry
from router_client.state import MirroredFleet

DATA = Path(__file__).resolve().parent.parent / "data"


def fleet_with(request_id="r1"):
    fleet = MirroredFleet(2, 4)
    fleet.enqueue(request_id, 12, 0.0)
    fleet.dispatch(request_id, 1, 0.0)
    return fleet


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_chat_stream_in_any_pieces(piece):
    raw = (DATA / "chat_stream.txt").read_bytes()
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    for start in range(0, len(raw), piece):
        telemetry.feed(raw[start:start + piece], 1.0)
    assert telemetry.close(2.0) == "stop"
    assert telemetry.done and telemetry.malformed == 0
    assert telemetry.generated == 5  # usage.completion_tokens wins over the 4 counted deltas
    assert "r1" not in fleet.active and not fleet.per_worker[1]
    assert fleet.take_outcomes()[0]["output_tokens"] == 5


def test_completions_stream_with_crlf_comments_and_length():
    raw = (DATA / "completions_stream.txt").read_bytes()
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    telemetry.feed(raw, 1.0)
    assert telemetry.finished == "length" and telemetry.generated == 4
    assert fleet.ended["r1"] == "length"


def test_progress_advances_while_streaming():
    raw = (DATA / "chat_stream.txt").read_bytes()
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    events = raw.split(b"\n\n")
    telemetry.feed(b"\n\n".join(events[:4]) + b"\n\n", 1.0)  # role chunk + 3 deltas
    assert fleet.active["r1"].generated == 3


def test_malformed_chunks_are_counted_and_skipped():
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    telemetry.feed(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
                   b"data: {not json\n\n"
                   b'data: {"choices": "nope"}\n\n'
                   b'data: {"choices": [7]}\n\n'
                   b'data: [1, 2]\n\n'
                   b'data: {"choices": [{"delta": {"content": "y"}, "finish_reason": "stop"}]}\n\n',
                   1.0)
    assert telemetry.malformed == 4
    assert telemetry.generated == 2 and telemetry.finished == "stop"


def test_stream_cut_midway_ends_as_error():
    raw = (DATA / "chat_stream.txt").read_bytes()
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    telemetry.feed(raw[: len(raw) // 2], 1.0)
    assert telemetry.close(2.0) == "error"
    outcome = fleet.take_outcomes()[0]
    assert outcome["finish_reason"] == "error" and outcome["output_tokens"] >= 1
    assert not fleet.active


def test_unknown_finish_reason_is_error_and_last_event_without_blank_line():
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    telemetry.feed(b'data: {"choices": [{"text": "a", "finish_reason": "content_filter"}]}', 1.0)
    assert telemetry.finished is None  # the event is not complete yet
    assert telemetry.close(2.0) == "error"
    assert telemetry.generated == 1


def test_parser_joins_multiline_data():
    parser = SSEParser()
    events = list(parser.feed(b"event: x\ndata: a\ndata: b\nid: 3\n\n"))
    assert events == ["a\nb"]


def test_tool_call_deltas_count_and_tool_calls_finish_is_a_natural_end():
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    call = b'{"index": 0, "function": {"arguments": "x"}}'
    telemetry.feed(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
                   + (b'data: {"choices": [{"delta": {"tool_calls": [' + call + b']}}]}\n\n') * 3
                   + b'data: {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}\n\n',
                   1.0)
    assert telemetry.generated == 3 and telemetry.reason == "tool_calls"
    assert telemetry.finished == "stop" and fleet.ended["r1"] == "stop"


def test_parser_events_are_bytes_split_once_across_pieces():
    parser = SSEParser()
    raw = b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n'
    got = [event for i in range(len(raw)) for event in parser.events(raw[i:i + 1])]
    assert got == [b'{"a": 1}', b"[DONE]"]


def test_observe_takes_an_already_parsed_chunk():
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1")
    assert telemetry.observe({"choices": [{"text": "a"}]}, 1.0)
    assert not telemetry.observe([1, 2], 1.0) and telemetry.malformed == 1
    assert telemetry.observe({"choices": [], "usage": {"completion_tokens": 4}}, 1.0)
    assert telemetry.generated == 4 and fleet.active["r1"].generated == 4


@pytest.mark.parametrize("fixed_length, recorded", [(False, "length"), (True, "stop")])
def test_a_length_finish_the_client_fixed_with_ignore_eos_is_recorded_complete(
        fixed_length, recorded):
    """A replay sends ``ignore_eos`` with ``max_tokens`` = the trace's length: its ``length``
    finish is the length it chose, not a cut; recorded as a cut, every observation of such a
    run reached the service censored and it could learn no length at all."""
    fleet = fleet_with()
    telemetry = StreamTelemetry(fleet, "r1", fixed_length=fixed_length)
    telemetry.feed(b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
                   b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n'
                   b'data: [DONE]\n\n', 1.0)
    assert telemetry.close(2.0) == "length" and telemetry.reason == "length"
    outcome = fleet.take_outcomes()[0]
    assert outcome["finish_reason"] == recorded and outcome["output_tokens"] == 2
