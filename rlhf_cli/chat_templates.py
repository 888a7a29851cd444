"""Built-in chat templates for `model.chat_template` (tokenizers without one: base models, many
reward backbones), as Jinja strings transformers' `apply_chat_template` renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BUILTIN = {
    # OpenAI's ChatML, as Qwen and many fine-tunes use it
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama-2-chat: [INST] turns, an optional <<SYS>> block in the first one
    "llama2": (
        "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
        "{% for message in messages if message['role'] != 'system' %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' }}"
        "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
        "{{ message['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    # Anthropic HH-RLHF's dialogue format, the guide's reward template
    "hh": (
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '\\n\\nHuman: ' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ '\\n\\nAssistant: ' + message['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\n\\nAssistant:' }}{% endif %}"
    ),
}
# The text that ends each built-in template's assistant turn, where it is not the tokenizer's EOS
# (`llama2` and `hh` write `eos_token`): `install_chat_template` makes it one special token, and
# `end_of_turn_id` names it as a stop id, or a model trained on the template learns to end its
# answers with the text and never stops.
END_OF_TURN = {"chatml": "<|im_end|>"}


def chat_template_text(choice: str) -> str:
    """The Jinja text of a built-in template's name, or of a template file's path."""
    return BUILTIN.get(choice) or Path(choice).read_text(encoding="utf-8")


def install_chat_template(tokenizer: Any, choice: str) -> None:
    """Set `choice` (a built-in's name or a Jinja file) as `tokenizer`'s chat template, its
    end-of-turn text added as one special token where the tokenizer would split it (a base
    model's tokenizer), so a model learns to emit it as one token and generation stops on it."""
    tokenizer.chat_template = chat_template_text(choice)
    marker = END_OF_TURN.get(choice)
    if marker is not None and end_of_turn_id(tokenizer, choice) is None:
        tokenizer.add_tokens([marker], special_tokens=True)


def end_of_turn_id(tokenizer: Any, choice: str | None) -> int | None:
    """The id of the one token that ends an assistant turn of the built-in template `choice`
    in `tokenizer`; None where `choice` ends it with the tokenizer's EOS (or is a file), or
    where `tokenizer` splits the text into several tokens."""
    marker = END_OF_TURN.get(choice) if choice is not None else None
    if marker is None:
        return None
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def chat_template_problem(text: str) -> str | None:
    """Why a chat template cannot serve (None when it can): it must compile in the sandboxed
    Jinja environment transformers renders with, render one user turn with the generation
    prompt, and write that turn's content."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(text)
        rendered = template.render(
            messages=[{"role": "user", "content": "PROBE"}],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    except jinja2.TemplateSyntaxError as exc:
        return f"Jinja syntax error on line {exc.lineno}: {exc.message}"
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as exc:
        return f"does not render a user turn ({exc.__class__.__name__}: {exc})"
    if "PROBE" not in rendered:
        return "renders a user turn without its content"
    return None
