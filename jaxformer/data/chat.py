"""Chat templates: a pretrained model's `tokenizer_config.json` (or `chat_template.jinja`) template rendered as
transformers renders it (`apply_chat_template(..., tokenize=False)`), and the spans of the rendered text that each
assistant message produced (what supervised fine-tuning puts its loss on).

The template is Jinja run in jinja2's immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks,
loop controls; `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML) and the tokenizer's
special tokens as variables (bos_token, eos_token, unk_token, pad_token), so a published template renders the same
string here as there (tests/test_chat.py compares them).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jaxformer.errors import DataError

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _jinja2():
    try:
        import jinja2
    except ImportError:
        raise DataError("chat templates need the jinja2 package: pip install 'jaxformer[chat]' (or jinja2)") from None
    return jinja2


def _environment():
    jinja2 = _jinja2()
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


class ChatTemplate:
    """template: the Jinja source; special: {bos_token: "<s>", ...} (the strings the template may print); source:
    the file it came from, which errors name. DataError: an empty template (it would drop every message), or
    one that does not parse."""

    def __init__(self, template: str, special: dict[str, str] | None = None, source: str | Path | None = None):
        jinja2 = _jinja2()
        self.name = f"the chat template of {source}" if source else "the chat template"
        if not template.strip():
            raise DataError(f"{self.name} is empty: it would render every conversation as nothing")
        try:
            self.compiled = _environment().from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"{self.name} does not parse: {e.message} (line {e.lineno})") from None
        except Exception as e:              # a compile-time error of any other kind (e.g. RecursionError)
            raise DataError(f"{self.name} does not compile: {type(e).__name__}: {str(e)[:200]}") from None
        self.template, self.special = template, dict(special or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """messages [{"role": ..., "content": ...}, ...] -> the text the model sees."""
        jinja2 = _jinja2()
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"chat message {i} is not a {{role, content}} object: {str(m)[:120]}")
        try:
            return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"{self.name} refused the conversation: {type(e).__name__}: {str(e)[:200]}") from None
        except Exception as e:              # the template's own arithmetic, types, recursion ...
            raise DataError(f"{self.name} failed on the conversation: {type(e).__name__}: {str(e)[:200]}") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """-> (the whole conversation rendered, the [start, end) character span each assistant message added: from
        the end of the conversation before it with the generation prompt, to the end of the conversation up to it).
        DataError when the template does not render a conversation as an extension of its prefix (no span is
        then the assistant's alone)."""
        text, spans = self.render(messages), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(f"{self.name} does not render message {i} (assistant) as an extension of the "
                                f"conversation before it: its loss span cannot be found")
            spans.append((len(before), len(upto)))
        return text, spans


def read_chat_template(folder: str | Path) -> ChatTemplate | None:
    """A pretrained folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template: a
    string, or a list of named templates of which "default" is taken) with its special tokens; None without one."""
    folder = Path(folder)
    cfg_file = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{cfg_file} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict):
        raise DataError(f"{cfg_file} is not a JSON object")
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        try:
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{folder / 'chat_template.jinja'} is unreadable: {type(e).__name__}: {e}") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{cfg_file}: chat_template is a list without a 'default' template ({sorted(named)})")
        template = named["default"]
    if template is None:
        return None
    if not isinstance(template, str):
        raise DataError(f"{cfg_file}: chat_template is neither a string nor a list of named templates")
    source = folder / "chat_template.jinja" if (folder / "chat_template.jinja").is_file() else cfg_file
    special = {}
    for k in SPECIAL:
        v = cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[k] = v
    return ChatTemplate(template, special, source)
