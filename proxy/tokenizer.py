"""Exact prompt token counts from the served model's own tokenizer (``--tokenizer PATH``).

Without it the proxy estimates ``s_i`` as ``ceil(chars / 4)`` (:mod:`proxy.tokens`), which is
close on average for English text and far off elsewhere: Chinese text runs about one to two
characters a token, so the estimate puts a third or less of the prompt on the rank, and BR-0
and BR-H fill margins with loads that are not there. Given the model's ``tokenizer.json``
(Hugging Face ``tokenizers``: what vLLM and SGLang load), the proxy counts as the engine does:

- completions: ``prompt`` encoded with the tokenizer's special tokens (the BOS an engine adds);
  token ids are counted as they are; a list of prompts is summed;
- chat: ``messages`` rendered with the model's chat template (``chat_template`` in
  ``tokenizer_config.json``, or ``chat_template.jinja`` beside it) with the generation prompt,
  then encoded without special tokens (the template writes them), as ``apply_chat_template``
  does, in the environment transformers gives templates (``loopcontrols``, ``{% generation
  %}``, a ``tojson`` that keeps non-ASCII text); a message whose content is a list of text
  parts gets them joined with newlines, as vLLM passes them to a template that expects a
  string. Without a template, or where the template fails on a body (a template may refuse a
  role order it does not support, which the engine will then refuse too), each message's
  text is encoded and :data:`proxy.tokens.CHAT_OVERHEAD_PER_MESSAGE` added per message.

Counting holds the interpreter: a long text is encoded with ``encode_batch``, which lets it go
while the Rust code runs (the proxy counts a large body on a worker thread, so its event loop
keeps relaying tokens meanwhile), and a text past :data:`MAX_ENCODED_CHARS` is estimated, not
encoded (no model takes such a prompt; the engine will refuse it). Truncation and padding
saved in the file are turned off: they would cap or pad the count.

``PATH`` is a ``tokenizer.json`` or the model's directory holding one.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from .tokens import CHAT_OVERHEAD_PER_MESSAGE, completion_tokens, message_texts, text_tokens

log = logging.getLogger("balanceroute.proxy")

# Texts longer than this are estimated (tokens.text_tokens), not encoded: encoding 4 MB takes
# seconds, and no model's context holds a prompt this long
MAX_ENCODED_CHARS = 1 << 20
# Texts at least this long are encoded with encode_batch, which releases the interpreter's
# lock while it runs (encode keeps it); shorter ones with encode, cheaper per call
RELEASE_CHARS = 4096


class TokenizerError(ValueError):
    """The tokenizer at the path given cannot be loaded (the message says why)."""


def _special(config: dict[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken as saved)
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _template_text(config: dict[str, Any], folder: Path | None) -> str | None:
    """The default chat template: ``chat_template.jinja`` in the model's directory, else
    ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
    which ``default`` is taken)."""
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for templates: non-ASCII kept, keys in their order (jinja's own
    escapes both, which would count a Chinese tool description several times over)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> Any:
    """A sandboxed environment as transformers renders chat templates in."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's
        tokens with it): its body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def _flattened(messages: list[Any]) -> list[Any]:
    """Messages whose content is a list of text parts with the parts joined by newlines (as
    vLLM hands them to a template that takes a string); other content as it is."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(
                isinstance(part, dict) and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str) for part in content):
            message = {**message, "content": "\n".join(part["text"] for part in content)}
        out.append(message)
    return out


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (vLLM's: e.g. ``enable_thinking``), those that do
    not clash with what the counter passes itself."""
    extra = body.get("chat_template_kwargs")
    if not isinstance(extra, dict):
        return {}
    taken = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
    return {k: v for k, v in extra.items() if isinstance(k, str) and k not in taken}


class PromptCounter:
    """``s_i`` of a completions or chat body by a Hugging Face tokenizer (see the module)."""

    def __init__(self, tokenizer: Any, template: str | None = None, bos_token: str = "",
                 eos_token: str = "", source: str = "") -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.template = None
        self.bos_token, self.eos_token = bos_token, eos_token
        self._failed_once = False
        if template is not None:
            from jinja2.exceptions import TemplateError

            try:
                self.template = _environment().from_string(template)
            except TemplateError as exc:
                raise TokenizerError(f"{source}: the chat template does not parse: {exc}") from exc
        else:
            log.warning("%s: no chat template (tokenizer_config.json's chat_template, or "
                        "chat_template.jinja); chats are counted message by message", source)

    @classmethod
    def load(cls, path: str | Path) -> PromptCounter:
        """From a ``tokenizer.json`` or a directory holding one (with its
        ``tokenizer_config.json`` and chat template, where present)."""
        from tokenizers import Tokenizer

        location = Path(path)
        folder = location if location.is_dir() else None
        file = location / "tokenizer.json" if folder is not None else location
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json there (give the file, or the "
                                 "model's directory holding it)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own types for a bad file
            raise TokenizerError(f"{file}: not a tokenizer.json the tokenizers library can "
                                 f"read ({exc})") from exc
        tokenizer.no_truncation()  # a saved truncation would cap every count,
        tokenizer.no_padding()  # a saved padding raise it
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_file}: not readable JSON ({exc})") from exc
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_file}: not a JSON object")
        return cls(tokenizer, _template_text(config, file.parent), _special(config, "bos_token"),
                   _special(config, "eos_token"), str(file))

    def __call__(self, body: dict[str, Any]) -> int:
        """``s_i`` for the body (at least 1); the body has passed
        :func:`proxy.tokens.body_problem`."""
        if "messages" in body:
            return max(1, self._chat(body))
        return completion_tokens(body.get("prompt", ""), partial(self._encoded, special=True))

    def _encoded(self, text: str, special: bool) -> int:
        if len(text) > MAX_ENCODED_CHARS:
            return text_tokens(text)
        if len(text) >= RELEASE_CHARS:
            encoding, = self.tokenizer.encode_batch([text], add_special_tokens=special)
            return len(encoding.ids)
        return len(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def _chat(self, body: dict[str, Any]) -> int:
        messages = body.get("messages") or []
        if self.template is not None:
            from jinja2.exceptions import TemplateError

            try:
                text = self.template.render(
                    messages=_flattened(messages), add_generation_prompt=True,
                    tools=body.get("tools"), bos_token=self.bos_token,
                    eos_token=self.eos_token, **_template_kwargs(body))
            except (TemplateError, TypeError, ValueError, AttributeError, KeyError) as exc:
                if not self._failed_once:
                    self._failed_once = True
                    log.warning("the chat template failed on a request (%s); such requests are "
                                "counted message by message", exc)
            else:
                return self._encoded(text, False)
        total = sum(self._encoded(text, False) for text in message_texts(messages))
        return total + CHAT_OVERHEAD_PER_MESSAGE * len(messages)
