"""The emulator alone: exact lengths, usage, batch slots, cancellation, step log, metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from proxy.emulator import Emulator, EmulatorConfig

from .conftest import Launcher, rank_urls


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    launch = Launcher(str(tmp_path_factory.mktemp("emu")))
    try:
        yield launch.emulator(workers=2, batch=2, time_scale=20.0)
    finally:
        launch.stop_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_tokens", [1, 7, 40])
def test_ignore_eos_gives_exactly_max_tokens_with_usage(emu, max_tokens):
    client = openai.OpenAI(base_url=rank_urls(emu, 2)[1] + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="m", prompt=[1] * 50, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) == max_tokens
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == max_tokens
    assert chunks[-1].usage.prompt_tokens == 50
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x" * 40}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == max_tokens
    assert whole.usage.prompt_tokens == 10 + 4  # 40 chars / 4 + one message's overhead
    assert whole.choices[0].finish_reason == "length"


@pytest.mark.timeout(60)
def test_without_ignore_eos_lengths_are_seeded_and_capped(emu):
    client = openai.OpenAI(base_url=emu.url + "/v1", api_key="x", max_retries=0)
    for _ in range(5):
        answer = client.completions.create(model="m", prompt="hello", max_tokens=6)
        assert 1 <= answer.usage.completion_tokens <= 6
        reason = "length" if answer.usage.completion_tokens == 6 else "stop"
        assert answer.choices[0].finish_reason == reason


@pytest.mark.timeout(60)
def test_batch_slots_queue_the_excess_and_disconnect_cancels(emu):
    url = rank_urls(emu, 2)[0]
    body = {"prompt": [1] * 10, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10.0) as client:
        streams = [client.stream("POST", url + "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        readers = [response.iter_raw() for response in responses]  # (a dropped reader closes)
        for reader in readers[:2]:
            next(reader)  # running: the first tokens arrive
        metrics = client.get(url + "/metrics").text
        assert 'vllm:num_requests_running{model_name="balanceroute-emulated",engine="0"} 2' \
            in metrics
        assert "vllm:num_requests_waiting" in metrics and "} 1\n" in metrics
        for stream in streams:
            stream.__exit__(None, None, None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rank = client.get(emu.url + "/emulator/stats").json()["ranks"][0]
            if rank["active"] == 0 and rank["waiting"] == 0:
                break
            time.sleep(0.05)
        assert rank["active"] == 0 and rank["waiting"] == 0
        assert rank["cancelled"] >= 3


@pytest.mark.timeout(60)
def test_step_log_records_loads_of_every_rank(emu):
    since = httpx.get(emu.url + "/emulator/steps?since=0").json()["next"]
    client = openai.OpenAI(base_url=emu.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="m", prompt=[1] * 100, max_tokens=5,
                              extra_body={"ignore_eos": True})
    log = httpx.get(emu.url + f"/emulator/steps?since={since}").json()
    loads = [step["loads"] for step in log["steps"]]
    assert [load[0] for load in loads] == [100, 101, 102, 103, 104]  # s + a, one per step
    assert all(load[1] == 0 for load in loads)
    assert all(step["tokens"] == 1 for step in log["steps"])


BODY = {"prompt": [1] * 10, "max_tokens": 2, "ignore_eos": True}


async def _steps_when(emulator, count: int, timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while len(emulator.steps) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return list(emulator.steps)


def test_start_after_holds_the_first_step_until_the_first_wave_has_come():
    async def scenario():
        emulator = Emulator(EmulatorConfig(workers=2, batch=2, time_scale=1000.0,
                                           start_after=3))
        task = asyncio.create_task(emulator.run())
        emulator.submit(0, BODY)
        emulator.submit(1, BODY)
        await asyncio.sleep(0.1)
        held = list(emulator.steps)
        emulator.submit(0, BODY)
        steps = await _steps_when(emulator, 2)
        task.cancel()
        return held, steps

    held, steps = asyncio.run(scenario())
    assert held == []  # two of three: no step yet
    assert steps[0]["admitted"] == 3 and steps[0]["active"] == [2, 1]  # all three at step 0
    assert steps[0]["loads"] == [20, 10]


def test_start_after_gives_up_waiting_start_timeout_after_the_first_request():
    async def scenario():
        emulator = Emulator(EmulatorConfig(workers=2, batch=2, time_scale=1000.0,
                                           start_after=5, start_timeout_s=0.05))
        task = asyncio.create_task(emulator.run())
        await asyncio.sleep(0.1)  # nothing came: the clock of the timeout has not started
        emulator.submit(1, BODY)
        steps = await _steps_when(emulator, 1)
        task.cancel()
        return steps

    steps = asyncio.run(scenario())
    assert steps and steps[0]["admitted"] == 1 and steps[0]["active"] == [0, 1]


def test_start_after_is_refused_below_zero():
    with pytest.raises(ValueError, match="start_after"):
        Emulator(EmulatorConfig(start_after=-1))
