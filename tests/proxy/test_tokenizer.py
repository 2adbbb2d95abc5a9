"""``--tokenizer``: prompt tokens counted by the model's own tokenizer, against the tokenizers
library's encodings and chat templates rendered by hand."""

from __future__ import annotations

import json
import logging
import math

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from proxy.tokenizer import PromptCounter, TokenizerError
from proxy.tokens import CHAT_OVERHEAD_PER_MESSAGE, prompt_tokens

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today",
          "load balancing for decode fleets", "你好，世界。今天天气很好。"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
STRICT = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must "
          "be the user\\'s') }}{% endif %}" + TEMPLATE)


def build(folder, template: str | None = TEMPLATE, config: dict | None = None) -> Tokenizer:
    """A small byte-level BPE with a BOS, saved as a model directory would hold it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<s>", "</s>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if template is not None:
        settings["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **(config or {})}))
    return tokenizer


def first_token(stream) -> None:
    """Read a chat stream up to its first token (the role chunk may come before any step)."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return
    raise AssertionError("the stream ended without a token")


def chat_text(messages: list[dict]) -> str:
    """TEMPLATE rendered by hand."""
    return ("<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
            + "<|assistant|>")


def test_completions_prompt_counted_as_the_engine_encodes_it_bos_included(tmp_path):
    tokenizer = build(tmp_path)
    count = PromptCounter.load(tmp_path)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert count({"prompt": text}) == len(ids)
    assert count({"prompt": [text, "hello world"]}) == len(ids) + len(
        tokenizer.encode("hello world").ids)
    assert count({"prompt": [5, 6, 7]}) == 3  # token ids as they are
    assert count({"prompt": [[5, 6], "hello"]}) == 2 + len(tokenizer.encode("hello").ids)
    assert count({"prompt": ""}) == 1  # the BOS alone


def test_chinese_text_is_counted_exactly_where_the_estimate_is_a_fraction(tmp_path):
    tokenizer = build(tmp_path)
    count = PromptCounter.load(tmp_path / "tokenizer.json")  # the file itself will do too
    text = "今天天气很好，我们去公园散步吧。" * 8
    exact = len(tokenizer.encode(text).ids)
    assert count({"prompt": text}) == exact
    assert prompt_tokens({"prompt": text}) == math.ceil(len(text) / 4)
    assert exact > 2 * prompt_tokens({"prompt": text})  # what the estimate misses


def test_chat_rendered_with_the_models_template_then_encoded(tmp_path):
    tokenizer = build(tmp_path)
    count = PromptCounter.load(tmp_path)
    messages = [{"role": "system", "content": "load balancing"},
                {"role": "user", "content": "你好，世界。hello world"}]
    expected = len(tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)
    assert count({"messages": messages}) == expected
    assert tokenizer.encode(chat_text(messages), add_special_tokens=False).ids.count(
        tokenizer.token_to_id("<s>")) == 1  # the template's BOS, not a second one


def test_a_chat_template_file_beside_the_tokenizer_wins(tmp_path):
    tokenizer = build(tmp_path, template="{{ 'ignored' }}")
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    messages = [{"role": "user", "content": "hello"}]
    assert PromptCounter.load(tmp_path)({"messages": messages}) == len(
        tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)


def test_named_templates_take_the_default(tmp_path):
    tokenizer = build(tmp_path, template=None, config={"chat_template": [
        {"name": "tool_use", "template": "{{ 'x' }}"}, {"name": "default", "template": TEMPLATE}]})
    messages = [{"role": "user", "content": "hello"}]
    assert PromptCounter.load(tmp_path)({"messages": messages}) == len(
        tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)


def test_a_template_that_refuses_the_body_falls_back_to_messages_one_by_one(tmp_path, caplog):
    tokenizer = build(tmp_path, template=STRICT)
    count = PromptCounter.load(tmp_path)
    messages = [{"role": "system", "content": "hello world"},
                {"role": "user", "content": [{"type": "text", "text": "how are you"}]}]
    expected = (len(tokenizer.encode("hello world", add_special_tokens=False).ids)
                + len(tokenizer.encode("how are you", add_special_tokens=False).ids)
                + 2 * CHAT_OVERHEAD_PER_MESSAGE)
    with caplog.at_level(logging.WARNING, logger="balanceroute.proxy"):
        assert count({"messages": messages}) == expected
        assert count({"messages": messages}) == expected
    assert sum("chat template failed" in r.message for r in caplog.records) == 1  # once
    # a body the template takes: rendered, its text parts joined as vLLM joins them
    assert count({"messages": messages[1:2]}) == len(tokenizer.encode(chat_text(
        [{"role": "user", "content": "how are you"}]), add_special_tokens=False).ids)
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert count({"messages": [{"role": "user", "content": parts}]}) == len(tokenizer.encode(
        chat_text([{"role": "user", "content": "hello\nworld"}]), add_special_tokens=False).ids)
    assert count({"messages": [{"role": "user", "content": "hello"}]}) == len(
        tokenizer.encode(chat_text([{"role": "user", "content": "hello"}]),
                         add_special_tokens=False).ids)


def test_without_a_template_messages_are_encoded_one_by_one(tmp_path, caplog):
    tokenizer = build(tmp_path, template=None)
    messages = [{"role": "user", "content": "hello world"}]
    with caplog.at_level(logging.WARNING, logger="balanceroute.proxy"):
        count = PromptCounter.load(tmp_path)
    assert any("no chat template" in r.message for r in caplog.records)  # said at start
    assert count({"messages": messages}) == len(
        tokenizer.encode("hello world", add_special_tokens=False).ids) + CHAT_OVERHEAD_PER_MESSAGE


def test_templates_get_the_environment_transformers_gives_them(tmp_path):
    """``loopcontrols``, ``{% generation %}``, a ``tojson`` that keeps Chinese text as it is
    and keys in their order, and the request's ``chat_template_kwargs``."""
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}<|{{ m['role'] }}|>{{ m['content'] }}{% endgeneration %}"
                "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
                "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}")
    tokenizer = build(tmp_path, template=template)
    count = PromptCounter.load(tmp_path)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "今天天气"}}]
    rendered = "<|user|>hello" + json.dumps(tools, ensure_ascii=False)
    assert count({"messages": messages, "tools": tools}) == len(
        tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert count({"messages": messages, "tools": tools,
                  "chat_template_kwargs": {"enable_thinking": False}}) == len(
        tokenizer.encode(rendered + "<nothink>", add_special_tokens=False).ids)


def test_a_truncation_saved_in_the_file_does_not_cap_the_count(tmp_path):
    tokenizer = build(tmp_path)
    tokenizer.enable_truncation(8)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = "the quick brown fox jumps over the lazy dog " * 10
    tokenizer.no_truncation()
    assert PromptCounter.load(tmp_path)({"prompt": text}) == len(tokenizer.encode(text).ids) > 8


class Recording:
    """A tokenizer stand-in that says which call counted a text."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append("encode")
        return type("E", (), {"ids": [0] * len(text)})()

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append("encode_batch")
        return [type("E", (), {"ids": [0] * len(t)})() for t in texts]


def test_long_texts_are_encoded_by_the_call_that_lets_the_interpreter_go():
    """``encode`` holds the interpreter's lock while it runs, ``encode_batch`` releases it: a
    long prompt counted on the proxy's worker thread must not stall its event loop. Past
    MAX_ENCODED_CHARS the text is estimated (no model takes such a prompt)."""
    from proxy.tokenizer import MAX_ENCODED_CHARS, RELEASE_CHARS

    recording = Recording()
    count = PromptCounter(recording)
    assert count({"prompt": "x" * 100}) == 100 and recording.calls == ["encode"]
    assert count({"prompt": "x" * RELEASE_CHARS}) == RELEASE_CHARS
    assert recording.calls[-1] == "encode_batch"
    calls = len(recording.calls)
    assert count({"prompt": "x" * (MAX_ENCODED_CHARS + 4)}) == MAX_ENCODED_CHARS // 4 + 1
    assert len(recording.calls) == calls  # not encoded


def test_a_path_that_holds_no_tokenizer_is_refused_naming_it(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json there"):
        PromptCounter.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        PromptCounter.load(tmp_path)
    build(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="not a JSON object"):
        PromptCounter.load(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="does not parse"):
        PromptCounter.load(tmp_path / "model")


@pytest.mark.timeout(90)
def test_proxy_and_emulator_count_a_chinese_chat_as_the_tokenizer_does(tmp_path):
    """Real processes: the emulator (an engine counting with the model's tokenizer) and the
    proxy in front of it, both given ``--tokenizer``; the proxy's mirrored load of a running
    request starts at the engine's exact count, for a small body counted on the event loop and
    a large one counted on a thread."""
    import httpx
    import openai

    from .conftest import Launcher, assert_quiescent, rank_urls

    tokenizer = build(tmp_path / "model")
    launch = Launcher(str(tmp_path))
    try:
        emulator = launch.emulator(workers=1, batch=4, time_scale=0.5,
                                   extra=("--tokenizer", str(tmp_path / "model")))
        proxy = launch.proxy(rank_urls(emulator, 1), policy="br0", batch=4,
                             extra=("--tokenizer", str(tmp_path / "model")))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0,
                               timeout=30.0)
        for text in ("今天天气很好，我们去公园散步吧。" * 4,
                     "今天天气很好，我们去公园散步吧。" * 600):  # > 16 KB: on a thread
            messages = [{"role": "user", "content": text}]
            exact = len(tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)
            since = httpx.get(emulator.url + "/emulator/steps?since=0").json()["next"]
            stream = client.chat.completions.create(
                model="m", messages=messages, max_tokens=100_000, stream=True,
                extra_body={"ignore_eos": True})
            first_token(stream)  # running: a step has been logged
            metrics = httpx.get(proxy.url + "/metrics").text
            gauge = 'balanceroute_proxy_rank_kv_tokens{rank="0"}'
            mirrored = float(next(line.split()[-1] for line in metrics.splitlines()
                                  if line.startswith(gauge)))
            steps = httpx.get(emulator.url + f"/emulator/steps?since={since}").json()["steps"]
            stream.close()
            assert steps[0]["loads"] == [exact]  # the engine's count
            assert exact <= mirrored <= exact + 1000  # the proxy's: the same, plus tokens streamed
            assert exact > 2 * prompt_tokens({"messages": messages})  # the estimate's miss
        assert_quiescent(proxy)
    finally:
        launch.stop_all()


def test_a_bad_tokenizer_path_stops_the_proxy_and_the_emulator_with_a_clear_error(tmp_path,
                                                                                  capsys):
    from predictor.cli import main

    missing = str(tmp_path / "nowhere")
    assert main(["proxy", "--decode", "http://127.0.0.1:9", "--tokenizer", missing]) == 2
    assert f"{missing}: no tokenizer.json there" in capsys.readouterr().err
    assert main(["emulate", "--workers", "1", "--port", "9", "--tokenizer", missing]) == 2
    assert f"{missing}: no tokenizer.json there" in capsys.readouterr().err


def test_one_huge_prompt_cannot_swing_the_learned_factor():
    from proxy.tokens import PromptCalibration

    calibration = PromptCalibration(min_samples=20)
    for _ in range(19):
        calibration.observe(100, 100)
    calibration.observe(10, 1_000_000)  # clipped to 8x, and one request of twenty
    assert calibration.factor == pytest.approx(8 ** (1 / 20), rel=0.01)  # the older decayed
    assert calibration.factor < 1.12


def test_the_estimates_bias_is_learned_from_the_engines_counts():
    from proxy.tokens import PromptCalibration

    calibration = PromptCalibration(min_samples=20, half_life=50)
    for _ in range(19):
        calibration.observe(100, 350)
    assert calibration.factor == 1.0 and calibration.apply(100) == 100  # too few yet
    calibration.observe(100, 350)
    assert calibration.factor == pytest.approx(3.5) and calibration.apply(100) == 350
    for _ in range(500):  # the traffic changes: the old ratio fades
        calibration.observe(200, 220)
    assert calibration.factor == pytest.approx(1.1, rel=1e-3)
    calibration.observe(0, 50)  # nothing to learn from
    calibration.observe(50, 0)
    assert calibration.factor == pytest.approx(1.1, rel=1e-3)
    bounded = PromptCalibration(min_samples=1)
    bounded.observe(10, 1000)
    assert bounded.factor == pytest.approx(8.0) and bounded.apply(1) == 8


def test_only_bodies_the_estimate_reads_whole_teach_it():
    from proxy.tokens import calibratable

    text = {"role": "user", "content": "hello"}
    assert calibratable({"prompt": "hello"}) and calibratable({"prompt": ["a", "b"]})
    assert calibratable({"messages": [text]})
    assert calibratable({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}]})
    assert not calibratable({"prompt": [1, 2, 3]}) and not calibratable({"prompt": [[1], "a"]})
    assert not calibratable({"messages": [text], "tools": [{"type": "function"}]})
    assert not calibratable({"messages": [text, {"role": "assistant", "content": None,
                                                 "tool_calls": [{"id": "c"}]}]})
    assert not calibratable({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]})


@pytest.mark.timeout(120)
def test_without_a_tokenizer_the_proxy_learns_chinese_prompts_from_the_engines_usage(tmp_path):
    """The emulator counts exactly (an engine with the model's tokenizer); the proxy, not
    given one, estimates four characters a token and learns the bias from each finished
    request's ``usage.prompt_tokens``: after 20 requests its mirrored load of a new Chinese
    chat is near the engine's count instead of a fraction of it."""
    import httpx
    import openai

    from .conftest import Launcher, assert_quiescent, rank_urls

    tokenizer = build(tmp_path / "model")
    launch = Launcher(str(tmp_path))

    def factor(proxy) -> float:
        text = httpx.get(proxy.url + "/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("balanceroute_proxy_prompt_tokens_factor ")))

    try:
        emulator = launch.emulator(workers=1, batch=4, time_scale=0.5,
                                   extra=("--tokenizer", str(tmp_path / "model")))
        proxy = launch.proxy(rank_urls(emulator, 1), policy="br0", batch=4)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0,
                               timeout=30.0)
        sentences = ["今天天气很好，我们去公园散步吧。", "你好，世界。", "今天很好。"]
        for number in range(20):
            messages = [{"role": "user", "content": sentences[number % 3] * (1 + number % 4)}]
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
            assert answer.usage is not None and answer.usage.prompt_tokens == len(
                tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)
        learned = factor(proxy)
        assert learned > 3.0  # the estimate missed most of each prompt
        messages = [{"role": "user", "content": "今天天气很好，我们去公园散步吧。" * 5}]
        exact = len(tokenizer.encode(chat_text(messages), add_special_tokens=False).ids)
        estimate = prompt_tokens({"messages": messages})
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=100_000, stream=True,
            extra_body={"ignore_eos": True})
        first_token(stream)
        text = httpx.get(proxy.url + "/metrics").text
        gauge = 'balanceroute_proxy_rank_kv_tokens{rank="0"}'
        mirrored = float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith(gauge)))
        stream.close()
        # the factor applied (plus the tokens streamed so far); an average over the requests
        # seen, so this one's own ratio is met only roughly
        assert 0 <= mirrored - math.ceil(round(estimate * learned, 6)) < 1000
        assert mirrored >= 0.7 * exact
        assert estimate < 0.2 * exact  # what it would have been without learning
        assert_quiescent(proxy)
    finally:
        launch.stop_all()
