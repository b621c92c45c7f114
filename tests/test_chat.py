"""`jaxformer.data.chat`: a pretrained folder's chat template renders what transformers' apply_chat_template renders
(ChatML as Qwen writes it, Llama 2's with its BOS/EOS and role checks, Gemma's), from the file transformers itself
saved; and each assistant message's loss span is exactly the text it added.

Wrong implementations these catch: Jinja's default whitespace handling (trim_blocks/lstrip_blocks off: stray
newlines), the special tokens not passed in (an empty BOS), the generation prompt ignored, a span that starts at
the assistant's content and leaves out the template's own tokens before and after it (or includes the next user
turn)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from jaxformer.data.chat import ChatTemplate, read_chat_template  # noqa: E402
from jaxformer.errors import DataError  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}"
         "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
         "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
          "{% endfor %}")                     # newlines after block tags: what trim_blocks removes
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "gemma": GEMMA, "zephyr": ZEPHYR}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": " 4 "}]


def saved(tmp_path, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>", chat_template=template)
    hf.save_pretrained(tmp_path)
    return transformers.AutoTokenizer.from_pretrained(tmp_path), read_chat_template(tmp_path)


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendering_equals_transformers(tmp_path, name):
    hf, ours = saved(tmp_path, TEMPLATES[name])
    conversation = CONVERSATION if name != "gemma" else CONVERSATION[1:]
    for gen in (False, True):
        for upto in (2, len(conversation) - 1, len(conversation)):
            msgs = conversation[:upto]
            if name == "llama2" and msgs[-1]["role"] == "assistant" and gen:
                continue
            assert ours.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen), (name, gen, upto)


@pytest.mark.parametrize("name", TEMPLATES)
def test_assistant_spans_are_the_text_each_assistant_turn_added(tmp_path, name):
    _, ours = saved(tmp_path, TEMPLATES[name])
    conversation = CONVERSATION if name != "gemma" else CONVERSATION[1:]
    text, spans = ours.assistant_spans(conversation)
    pieces = [text[a:b] for a, b in spans]
    assert len(pieces) == 2
    for piece, m in zip(pieces, (m for m in conversation if m["role"] == "assistant")):
        assert m["content"].strip() in piece
        assert "user" not in piece and "2+2" not in piece and "[INST]" not in piece
    end = {"chatml": "<|im_end|>\n", "llama2": " </s>", "gemma": "<end_of_turn>\n", "zephyr": "</s>\n"}[name]
    assert all(p.endswith(end) for p in pieces)                      # the turn's end token is learned too


def test_template_errors_are_named(tmp_path):
    with pytest.raises(DataError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    _, llama = saved(tmp_path, LLAMA2)
    with pytest.raises(DataError, match="roles must alternate"):
        llama.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(DataError, match="not a {role, content}"):
        llama.render(["hello"])
    assert read_chat_template(tmp_path / "nothing") is None
