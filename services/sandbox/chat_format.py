"""Token framing of a multi-turn chat, derived once from a tokenizer's chat template.

The agent never re-tokenizes what the model produced: it appends the model's ids as they
came, then the framing that closes the assistant turn and opens the next user turn, then the
observation's own ids, then the framing that opens the next assistant turn. Each framing
piece is tokenized once, on its own, when the ChatFormat is built.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import ConfigError

_SYSTEM = "\x00RIPTIDE-SYSTEM\x00"
_USER_1 = "\x00RIPTIDE-USER-1\x00"
_ASSISTANT = "\x00RIPTIDE-ASSISTANT\x00"
_USER_2 = "\x00RIPTIDE-USER-2\x00"

# Used when a tokenizer has no chat template (plain byte-level tokenizers in tests).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _between(text: str, start: str, end: str | None) -> str:
    begin = text.index(start) + len(start)
    return text[begin:] if end is None else text[begin:text.index(end, begin)]


class ChatFormat:
    """The chat template's framing around user turns, as token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._template = getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ConfigError("the tokenizer has no eos_token_id: cannot close assistant turns")
        self.end_of_turn_id = int(eos)
        eos_text = tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
        text = self._render(
            [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER_1},
             {"role": "assistant", "content": _ASSISTANT}, {"role": "user", "content": _USER_2}],
            add_generation_prompt=True,
        )
        between = _between(text, _ASSISTANT, _USER_2)
        if not between.startswith(eos_text):
            raise ConfigError(
                f"the chat template does not end assistant turns with the eos token {eos_text!r}; "
                "set the tokenizer's eos_token to the template's end-of-turn token")
        #: Ids that follow the end-of-turn token and open a user turn.
        self.user_open_ids = self.encode(between[len(eos_text):])
        #: Ids that close a user turn and open the next assistant turn.
        self.assistant_open_ids = self.encode(_between(text, _USER_2, None))

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        rendered = self.tokenizer.apply_chat_template(
            messages, chat_template=self._template, tokenize=False,
            add_generation_prompt=add_generation_prompt)
        return str(rendered)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` alone, without special tokens added around it."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of model ids, special tokens dropped."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompt_ids(self, system: str, user: str) -> list[int]:
        """The episode's prompt: system and first user message, then the assistant opening."""
        text = self._render([{"role": "system", "content": system},
                             {"role": "user", "content": user}], add_generation_prompt=True)
        return self.encode(text)

    def user_turn_ids(self, model_ids: list[int], observation: str) -> list[int]:
        """Ids to append after a model turn: close it if the model did not, the observation
        as a user turn, then the opening of the next assistant turn."""
        close = [] if model_ids and model_ids[-1] == self.end_of_turn_id else [self.end_of_turn_id]
        return close + self.user_open_ids + self.encode(observation) + self.assistant_open_ids
