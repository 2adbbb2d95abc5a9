import functools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from router_client.errors import TraceError, TraceFormatError
from router_client.synth import parse_spec, synthesize
from router_client.traces import detect_format, load_trace, parse_trace, parse_trace_head


def test_azure_trace_as_published(shared_traces):
    trace = load_trace(str(shared_traces / "AzureLLMInferenceTrace_conv.csv"))
    assert len(trace) == 19366  # includes the last line, which has no final newline
    assert int(trace.censored.sum()) == 11  # the rows exactly at the 1000-token cap
    assert trace.output_tokens.max() == 1000
    assert trace.arrival_s[0] == 0.0
    assert trace.arrival_s[-1] == pytest.approx(3501.72, abs=0.01)
    assert np.all(np.diff(trace.arrival_s) >= 0)
    assert trace.prompt_tokens.mean() == pytest.approx(1155, abs=1)


def test_mooncake_trace_spreads_quantized_timestamps(shared_traces):
    trace = load_trace(str(shared_traces / "conversation_trace.jsonl"))
    assert len(trace) == 12031
    assert int(trace.censored.sum()) == 30
    assert np.all(np.diff(trace.arrival_s) >= 0)
    # 1,180 distinct raw timestamps; after spreading, almost all arrivals are distinct
    assert np.unique(trace.arrival_s).size > 12000
    # the prompt key is the conversation: multi-turn requests share it
    keys = [k for k in trace.prompt_keys if k is not None]
    assert len(keys) == 12031 and len(set(keys)) < 0.8 * len(keys)


def test_sharegpt_has_no_times(shared_traces):
    trace = load_trace(str(shared_traces / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
                       requests=500)
    assert len(trace) == 500 and trace.arrival_s is None
    full = load_trace(str(shared_traces / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"))
    assert len(full) == 30731 and int(full.censored.sum()) == 4


def test_azure_2024_timestamps_with_a_utc_offset():
    """The 2024 Azure traces write ``2024-05-10 00:00:00.009930+00:00``: the offset is
    applied (the same instants written in another zone give the same arrivals), and the
    parse raises no numpy time-zone warning (``-W error`` in CI would turn it into a crash)."""
    utc = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
           "2024-05-10 00:00:00.009930+00:00,4808,10\n2024-05-10 00:00:01+00:00,3180,8\n"
           "2024-05-10T00:00:02.5Z,110,27\n")
    shifted = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
               "2024-05-10 02:00:00.009930+02:00,4808,10\n2024-05-09 23:30:01-0030,3180,8\n"
               "2024-05-10 00:00:02.5,110,27\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = parse_trace(utc, "auto", "a.csv"), parse_trace(shifted, "azure", "b.csv")
    assert first.arrival_s == pytest.approx([0.0, 0.99007, 2.49007])
    assert second.arrival_s == pytest.approx(first.arrival_s)
    with pytest.raises(TraceFormatError, match="TIMESTAMP is not a date-time"):
        parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00+0x:00,1,2\n",
                    "azure", "c.csv")


@pytest.mark.parametrize(
    "text, fmt, line, fragment",
    [
        ("arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,x,3\n", "csv", 3, "prompt_tokens"),
        ("arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,2\n", "csv", 3, "expected 3 fields"),
        ("arrival_s,prompt_tokens,output_tokens\n0,1,0\n", "csv", 2, "output_tokens must be >= 1"),
        ("arrival_s,prompt_tokens,output_tokens\n5,1,2\n1,1,2\n", "csv", 3, "backwards"),
        ("arrival_s,prompt_tokens,output_tokens,finish_reason\n0,1,2,maybe\n", "csv", 2,
         "finish_reason"),
        ("arrival_s,prompt_tokens\n0,1\n", "csv", 1, "output_tokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,2\nyesterday,1,2\n",
         "azure", 3, "TIMESTAMP"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1\n',
         "mooncake", 2, "not valid JSON"),
        ('{"timestamp": 0, "input_length": 5}\n', "mooncake", 1, "output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": "x"}\n',
         "mooncake", 1, "hash_ids"),
        ('[1, 2]\n', "mooncake", 1, "JSON object"),
        ("num_prefill_tokens,num_decode_tokens\n1,2\n3,-4\n", "sharegpt", 3, "num_decode_tokens"),
    ],
)
def test_malformed_lines_name_the_line(text, fmt, line, fragment):
    with pytest.raises(TraceFormatError) as caught:
        parse_trace(text, fmt, "t.txt")
    assert caught.value.line == line
    assert fragment in str(caught.value)
    assert f"t.txt, line {line}" in str(caught.value)


@pytest.mark.parametrize(
    "text, fragment",
    [("", "empty"), ("hello,world\n1,2\n", "cannot tell the format"),
     ("arrival_s,prompt_tokens,output_tokens\n", "no requests")],
)
def test_unusable_files(text, fragment):
    with pytest.raises(TraceError, match=fragment):
        parse_trace(text, "auto", "t.txt")


def test_detect_format():
    assert detect_format("x", '{"timestamp": 0}') == "mooncake"
    assert detect_format("x", "TIMESTAMP,ContextTokens,GeneratedTokens") == "azure"
    assert detect_format("x", "num_prefill_tokens,num_decode_tokens,x") == "sharegpt"
    assert detect_format("x", "arrival_s,prompt_tokens,output_tokens") == "csv"


def test_generic_csv_keys_and_censoring():
    text = ("arrival_s,prompt_tokens,output_tokens,prompt_key,finish_reason\n"
            "0,10,5,a,stop\n0.5,11,6,,length\n1.0,12,7,b,cancelled\n")
    trace = parse_trace(text)
    assert trace.prompt_keys == ["a", None, "b"]
    assert list(trace.censored) == [False, True, True]


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "nope.csv"))
    with pytest.raises(TraceError, match="unknown format"):
        parse_trace("x", "parquet")


def test_synthetic_workloads_match_their_documented_shape():
    long = synthesize("synth:long")
    assert len(long) == 10000
    assert long.prompt_tokens.mean() == pytest.approx(3200, rel=0.05)
    assert long.output_tokens.mean() == pytest.approx(1185, rel=0.05)
    templated = synthesize("synth:templated:templates=8,n=2000")
    assert len(set(templated.prompt_keys)) == 8
    shift = synthesize("synth:shift:n=4000")
    first, second = shift.output_tokens[:2000], shift.output_tokens[2000:]
    assert second.mean() > 3 * first.mean()
    assert np.array_equal(synthesize("synth:long:n=50,seed=3").output_tokens,
                          synthesize("synth:long:n=50,seed=3").output_tokens)


def test_requests_of_a_synthetic_workload_are_not_capped_by_its_default_size():
    # --requests N past the default n (10,000 for long) synthesizes N; N below it, N as
    # before (the same trace: seeded draws of that count); an n the spec sets caps N
    assert len(load_trace("synth:long:seed=2", requests=12000)) == 12000
    assert np.array_equal(load_trace("synth:long:seed=2", requests=300).output_tokens,
                          synthesize("synth:long:seed=2,n=300").output_tokens)
    assert len(load_trace("synth:templated:n=500", requests=800)) == 500
    assert len(load_trace("synth:templated:n=500", requests=200)) == 200
    assert len(load_trace("synth:shift")) == 20000
    with pytest.raises(TraceError, match="at least 1"):
        load_trace("synth:long", requests=0)


@pytest.mark.parametrize("spec, fragment", [("synth:nope", "unknown synthetic"),
                                            ("synth:long:n=x", "must be a number"),
                                            ("synth:long:bogus=1", "bad parameter"),
                                            ("synth:long:n=1.5", "integer")])
def test_bad_synth_specs(spec, fragment):
    with pytest.raises(TraceError, match=fragment):
        parse_spec(spec)


def test_tile_replays_the_trace_back_to_back_with_its_burst_shape():
    from router_client.simulator import SimConfig, arrival_steps
    from router_client.traces import Trace

    trace = Trace("t", np.array([10, 20, 30]), np.array([5, 6, 7]), np.array([False, True, False]),
                  ["a", None, "c"], np.array([100.0, 101.0, 104.0]))
    tiled = trace.tile(7)
    assert tiled.prompt_tokens.tolist() == [10, 20, 30, 10, 20, 30, 10]
    assert tiled.censored.tolist() == [False, True, False] * 2 + [False]
    assert tiled.prompt_keys == ["a", None, "c", "a", None, "c", "a"]
    # each copy starts one mean gap (2 s) after the previous copy's last arrival
    assert tiled.arrival_s.tolist() == [100, 101, 104, 106, 107, 110, 112]
    gaps = np.diff(tiled.arrival_s)
    assert gaps.tolist() == [1, 3, 2, 1, 3, 2]
    # the load still sets the mean arrival rate
    steps = arrival_steps(tiled, SimConfig(workers=2, batch=4, load=1.0))
    rate = 1.0 * 2 * 4 / tiled.output_tokens.mean()
    assert (len(tiled) - 1) / steps[-1] == pytest.approx(rate * (len(tiled) - 1) / len(tiled))
    assert trace.tile(2).prompt_tokens.tolist() == [10, 20]  # long enough: the head
    untimed = Trace("u", trace.prompt_tokens, trace.output_tokens, trace.censored,
                    trace.prompt_keys)
    assert untimed.tile(5).arrival_s is None and len(untimed.tile(5)) == 5
    with pytest.raises(Exception, match="at least 1"):
        trace.tile(0)


@functools.cache
def _whole_file(path: str):
    return parse_trace(Path(path).read_text(encoding="utf-8"), "auto", path)


@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_conv.csv", "conversation_trace.jsonl",
                                  "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"])
@pytest.mark.parametrize("requests", [1, 2, 7, 1000, 4010, 12031, 40000])
def test_first_requests_read_alone_equal_the_whole_files_head(shared_traces, name, requests):
    """``--requests N`` reads only the start of the file, and gets exactly the rows (and, for
    Mooncake, the spread arrivals: its last timestamp bucket is read to its end) that
    parsing the whole file and keeping N gives."""
    path = shared_traces / name
    full = _whole_file(str(path))
    whole = full.head(requests)
    text = path.read_text(encoding="utf-8") if requests in (7, 4010) else None
    for fmt in ("auto", {"A": "azure", "c": "mooncake", "s": "sharegpt"}[name[0]]):
        heads = [load_trace(str(path), fmt, requests)]
        if text is not None:  # an uploaded trace (POST /v1/ab-comparisons): the same rows
            heads.append(parse_trace_head(text, fmt, "upload", requests))
        for head in heads:
            _same_rows(head, whole, min(requests, len(full)))


def _same_rows(head, whole, count: int) -> None:
    assert len(head) == len(whole) == count
    assert np.array_equal(head.prompt_tokens, whole.prompt_tokens)
    assert np.array_equal(head.output_tokens, whole.output_tokens)
    assert np.array_equal(head.censored, whole.censored)
    assert head.prompt_keys == whole.prompt_keys
    if whole.arrival_s is None:
        assert head.arrival_s is None
    else:
        assert np.array_equal(head.arrival_s, whole.arrival_s)


def test_first_requests_stop_reading_the_file(tmp_path):
    """Rows past the first N are not read: a broken line there does not stop a replay of the
    first N, while one among them is still reported with its line number."""
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,20,6\n"
                        "2,30,7\nnot,a,row\n")
    assert load_trace(str(csv_path), "auto", 3).output_tokens.tolist() == [5, 6, 7]
    assert load_trace(str(csv_path), "csv", 2).prompt_tokens.tolist() == [10, 20]
    with pytest.raises(TraceFormatError, match="line 5"):
        load_trace(str(csv_path), "auto", 4)
    moon = tmp_path / "m.jsonl"
    moon.write_text('{"timestamp": 0, "input_length": 5, "output_length": 3}\n'
                    '{"timestamp": 3000, "input_length": 6, "output_length": 4}\n'
                    '{"timestamp": 3000, "input_length": 7, "output_length": 5}\n'
                    '{"timestamp": 6000, "input_length": 8, "output_length": 6}\n{broken\n')
    head = load_trace(str(moon), "auto", 2)
    # the second row shares its timestamp with the third: spread over the gap to 6000 ms
    assert head.arrival_s.tolist() == [0.0, 3.0]
    assert load_trace(str(moon), "auto", 3).arrival_s.tolist() == [0.0, 3.0, 4.5]
    with pytest.raises(TraceError, match="at least 1"):
        load_trace(str(moon), "auto", 0)


BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "45,ChatGPT,1087,0,1087,Conversation log\n"  # a failed request
            "45,GPT-4,417,276,693,API log\n45,ChatGPT,1360,140,1500,Conversation log\n"
            "49,ChatGPT,34,17,51,API log\n52,GPT-4,100,0,100,API log\n"
            "60,ChatGPT,10,5,15,Conversation log\n")


def test_burstgpt_trace(tmp_path):
    """BurstGPT is detected from its header; failed requests (0 response tokens) are left
    out; requests sharing a second are spread over the gap to the next; ``--requests N``
    counts requests, not failed rows, and reads the last kept second to its end."""
    assert detect_format("x", BURSTGPT.splitlines()[0]) == "burstgpt"
    trace = parse_trace(BURSTGPT, "auto", "b.csv")
    assert trace.prompt_tokens.tolist() == [472, 417, 1360, 34, 10]
    assert trace.output_tokens.tolist() == [18, 276, 140, 17, 5]
    assert not trace.censored.any() and trace.prompt_keys == [None] * 5
    assert trace.arrival_s.tolist() == [0.0, 40.0, 42.0, 44.0, 55.0]
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT)
    for n in (1, 2, 3, 4, 5, 9):
        head = load_trace(str(path), "auto", n)
        assert head.output_tokens.tolist() == trace.output_tokens.tolist()[:n]
        assert head.arrival_s.tolist() == trace.arrival_s.tolist()[:n]


@pytest.mark.parametrize("row, fragment", [
    ("50,ChatGPT,x,3,3,API log", "Request tokens"),
    ("50,ChatGPT,3,-1,3,API log", "Response tokens"),
    ("yesterday,ChatGPT,3,3,6,API log", "Timestamp"),
    ("1,ChatGPT,3,3,6,API log", "backwards"),
])
def test_burstgpt_malformed_rows_name_the_line(row, fragment):
    with pytest.raises(TraceFormatError, match=fragment) as caught:
        parse_trace(BURSTGPT + row + "\n", "burstgpt", "b.csv")
    assert caught.value.line == 9


def head_prompts(path: Path, text: str, *reads: tuple[str, int]) -> list[list[int]]:
    """``text`` written to ``path``, then read with ``--requests``: the prompt sizes of each
    (format, N) read."""
    path.write_text(text)
    return [load_trace(str(path), fmt, n).prompt_tokens.tolist() for fmt, n in reads]


def test_azure_rows_without_output_are_left_out(tmp_path):
    """A row with 0 generated tokens (nothing to decode) is not a request of the replay, in a
    whole-file read and in a ``--requests`` read alike; a negative count is still an error."""
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:01+00:00,10,0\n"
            "2024-05-10 00:00:02+00:00,20,3\n2024-05-10 00:00:03+00:00,30,0\n"
            "2024-05-10 00:00:05+00:00,40,4\n")
    trace = parse_trace(text, "auto", "a.csv")
    assert trace.prompt_tokens.tolist() == [20, 40] and trace.arrival_s.tolist() == [0.0, 3.0]
    assert head_prompts(tmp_path / "a.csv", text, ("auto", 1), ("azure", 2)) == [[20], [20, 40]]
    with pytest.raises(TraceFormatError, match="GeneratedTokens must be >= 0"):
        parse_trace(text + "2024-05-10 00:00:06+00:00,1,-2\n", "azure", "a.csv")


def test_mooncake_and_sharegpt_records_without_output_are_left_out(tmp_path):
    """As Azure's and BurstGPT's: a record with no output token (nothing to decode) is not a
    request of the replay, whole file and ``--requests`` read alike (where the quick read
    counts requests, a left-out record does not count); a negative count is still an error,
    and a file of such records only has no request to replay."""
    mooncake = "".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o,
                                   "hash_ids": [1, p]}) + "\n"
                       for t, p, o in ((0, 10, 0), (3000, 20, 3), (3000, 30, 0.0),
                                       (6000, 40, 4), (9000, 50, 5)))
    trace = parse_trace(mooncake, "auto", "m.jsonl")
    assert trace.prompt_tokens.tolist() == [20, 40, 50]
    assert head_prompts(tmp_path / "m.jsonl", mooncake, ("auto", 1), ("mooncake", 2)) == [
        [20], [20, 40]]
    with pytest.raises(TraceFormatError, match="output_length must be >= 0"):
        parse_trace(mooncake.replace('"output_length": 4', '"output_length": -4'), "mooncake",
                    "m.jsonl")
    with pytest.raises(TraceFormatError, match="hash_ids"):  # checked on a left-out record too
        parse_trace(mooncake.replace('[1, 10]', '"x"'), "mooncake", "m.jsonl")
    sharegpt = "num_prefill_tokens,num_decode_tokens\n10,0\n20,3\n30,00\n40,4\n"
    assert parse_trace(sharegpt, "sharegpt", "s.csv").prompt_tokens.tolist() == [20, 40]
    assert head_prompts(tmp_path / "s.csv", sharegpt, ("sharegpt", 1), ("sharegpt", 2)) == [
        [20], [20, 40]]
    with pytest.raises(TraceFormatError, match="num_decode_tokens must be >= 0"):
        parse_trace(sharegpt + "5,-1\n", "sharegpt", "s.csv")
    with pytest.raises(TraceError):
        parse_trace("num_prefill_tokens,num_decode_tokens\n10,0\n", "sharegpt", "s.csv")


@pytest.mark.parametrize("name, text", [
    ("cr.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\r2023-11-16 18:17:03.97,10,5\r"
               "2023-11-16 18:17:04.97,11,6\r2023-11-16 18:17:05.97,12,7\r"),
    ("zero.csv", 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,"0"\n'
                 "2023-11-16 18:17:04.97,11,00\n2023-11-16 18:17:05.97,12,7\n"
                 "2023-11-16 18:17:06.97,13,8\n"),
    ("quoted.csv", 'arrival_s,prompt_tokens,output_tokens,prompt_key\n0,1,2,"a\nb"\n1,2,3,c\n'
                   "2,3,4,d\n"),
    ("burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                  '5,"Chat,GPT",10,3,13,API log\n5,GPT-4,11,0,11,API log\n'
                  "5,GPT-4,12,4,16,API log\n9,GPT-4,13,5,18,API log\n"),
])
def test_first_requests_as_the_parser_counts_them(tmp_path, name, text):
    """The ``--requests`` read counts what the parser keeps: CR-only line ends, a zero
    written ``"0"`` or ``00``, a quoted field with a newline or a comma in it."""
    path = tmp_path / name
    path.write_bytes(text.encode())
    whole = parse_trace(path.read_text(encoding="utf-8"), "auto", name)
    for n in range(1, len(whole) + 2):
        head, expected = load_trace(str(path), "auto", n), whole.head(n)
        assert head.prompt_tokens.tolist() == expected.prompt_tokens.tolist()
        assert head.prompt_keys == expected.prompt_keys
        if expected.arrival_s is not None:
            assert head.arrival_s.tolist() == expected.arrival_s.tolist()


def test_split_is_the_past_and_the_traffic_after_it():
    from router_client.errors import ParameterError

    trace = synthesize("synth:templated:n=50,seed=1")
    past, rest = trace.split(20, "--warm")
    assert (len(past), len(rest)) == (20, 30)
    np.testing.assert_array_equal(np.concatenate([past.output_tokens, rest.output_tokens]),
                                  trace.output_tokens)
    np.testing.assert_array_equal(rest.arrival_s, trace.arrival_s[20:])
    assert past.prompt_keys + rest.prompt_keys == trace.prompt_keys
    for n in (0, 50, 51):
        with pytest.raises(ParameterError, match=f"warm_requests: {n}: .*below the 50"):
            trace.split(n, "warm_requests")
