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
        vocab_size=300, special_tokens=["<s>", "</s>", "<|end|>"],
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
    assert count({"messages": messages[1:2]}) > 0  # a body the template takes: rendered
    assert count({"messages": [{"role": "user", "content": "hello"}]}) == len(
        tokenizer.encode(chat_text([{"role": "user", "content": "hello"}]),
                         add_special_tokens=False).ids)


def test_without_a_template_messages_are_encoded_one_by_one(tmp_path):
    tokenizer = build(tmp_path, template=None)
    messages = [{"role": "user", "content": "hello world"}]
    assert PromptCounter.load(tmp_path)({"messages": messages}) == len(
        tokenizer.encode("hello world", add_special_tokens=False).ids) + CHAT_OVERHEAD_PER_MESSAGE


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
    assert bounded.factor == 8.0 and bounded.apply(1) == 8


def test_only_text_is_estimated():
    from proxy.tokens import text_estimated

    assert text_estimated({"prompt": "hello"}) and text_estimated({"messages": []})
    assert text_estimated({"prompt": [[1, 2], "hello"]})
    assert not text_estimated({"prompt": [1, 2, 3]}) and not text_estimated({"prompt": [[1]]})


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
        assert mirrored >= 0.8 * exact and mirrored - math.ceil(estimate * learned) < 1000
        assert estimate < 0.4 * exact  # what it would have been without learning
        assert_quiescent(proxy)
    finally:
        launch.stop_all()
