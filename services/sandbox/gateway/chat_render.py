"""A chat request's prompt as token ids, with the episode's own assistant turns spliced in.

The model's chat template renders the messages on our side. Every assistant message that is
one of the gateway's own replies of this episode (same text and tool calls) is not
re-rendered: a sentinel stands in its place, and the ids the engine generated for it go there.
So a harness that sends its history back unchanged extends the episode's tokens exactly, even
where re-encoding the reply's text would give other ids (a byte-pair split the engine did not
sample) or where the template would render the turn otherwise (dropped reasoning, its own
tool-call format). A message that is not one of our replies is rendered as sent: the
trajectory then opens a new segment (services/sandbox/token_trace.py).

Which history is "ours" is judged against the assistant turns of the previous call plus its
reply, in order: after a harness rewrote its history once (a summary, a fresh start), the
calls that extend the rewritten history are ours again. Replies are matched by position in
that history first, then by fingerprint anywhere in the episode (a summary that keeps a
reply verbatim still gets its generated ids).

Pieces of rendered text between sentinels are encoded on their own and cached per episode:
a call re-encodes only what is new.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import orjson

_CACHE_PIECES = 512


@cache
def _sentinel(index: int) -> str:
    """What stands in for the index-th spliced reply while the template renders (made once:
    formatting it twice per reply per call cost a tenth of a render)."""
    return f"\x00RIPTIDE-REPLY-{index}\x00"


def _compiled(template: str | None) -> Any:
    """transformers' own compiled Jinja template (its sandbox, filters and globals), or None
    where this transformers has no such helper: then apply_chat_template renders."""
    if template is None:
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    compiled = _compile_jinja_template(template)
    # Its globals are a ChainMap (the template's over the environment's), which every render
    # copies into a dict and a set key by key: a fixed dict renders the same text at 0.6x.
    compiled.globals = dict(compiled.globals)
    return compiled


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight from the Rust tokenizer
    where that is all it does (a fast tokenizer that neither overrides decoding nor cleans up
    spaces): its Python layers cost several times a short reply's decoding."""
    try:
        from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:
        return partial(tokenizer.decode, skip_special_tokens=True)
    kind = type(tokenizer)
    if (isinstance(tokenizer, Fast) and kind.decode is Fast.decode
            and kind._decode is Fast._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


def reply_fingerprint(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """What identifies an assistant message: its text and its tool calls (name, arguments as
    canonical JSON where they parse)."""
    calls = []
    for call in tool_calls or []:
        function = call.get("function") or {} if isinstance(call, dict) else {}
        arguments = function.get("arguments", "")
        try:
            arguments = orjson.dumps(orjson.loads(arguments), option=orjson.OPT_SORT_KEYS).decode()
        except (orjson.JSONDecodeError, TypeError):
            arguments = str(arguments)
        calls.append([str(function.get("name", "")), arguments])
    return orjson.dumps([(content or "").strip(), calls]).decode()


@dataclass(frozen=True)
class Reply:
    """An assistant turn of a history: how to recognize it, and the ids the engine generated
    for it (None: a turn the harness wrote, rendered from its text)."""

    fingerprint: str
    ids: list[int] | None


@dataclass(frozen=True)
class RenderedPrompt:
    """A call's prompt ids, its assistant turns, and whether its history was the one expected."""

    ids: list[int]
    #: The assistant messages were the expected history's, in order, and none was left out.
    history_is_ours: bool
    #: Its assistant turns, in order, as rendered (with the ids spliced in, where any).
    assistants: list[Reply]


class ChatRenderer:
    """Renders chat requests of one episode with the model's chat template."""

    def __init__(self, tokenizer: Any, chat_template: str | None, end_of_turn_ids: set[int]
                 ) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template
        self.end_of_turn_ids = end_of_turn_ids
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._compiled = _compiled(chat_template)
        self._decode = _decoder(tokenizer)
        self._special = {name: value for name, value in
                         getattr(tokenizer, "special_tokens_map", {}).items()
                         if isinstance(value, str)}

    def encode(self, text: str) -> list[int]:
        """Ids of `text` alone (no special tokens added), cached."""
        ids = self._pieces.get(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._pieces[text] = ids
            if len(self._pieces) > _CACHE_PIECES:
                self._pieces.popitem(last=False)
        else:
            self._pieces.move_to_end(text)
        return ids

    def decode_reply(self, ids: list[int]) -> str:
        """The text of generated ids (no end-of-turn id, no special tokens)."""
        return self._decode([i for i in ids if i not in self.end_of_turn_ids])

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               history: list[Reply], known: dict[str, list[int]] | None = None,
               ) -> RenderedPrompt:
        """The prompt of a chat call, our replies spliced in as the engine generated them.
        `history`: the assistant turns expected (the previous call's and its reply); `known`:
        the ids of every reply of the episode by fingerprint."""
        substituted: list[dict[str, Any]] = []
        spliced: list[list[int]] = []
        assistants: list[Reply] = []
        ours = True
        for message in messages:
            if message.get("role") != "assistant":
                substituted.append(message)
                continue
            position = len(assistants)
            fingerprint = reply_fingerprint(message.get("content"), message.get("tool_calls"))
            if ours and position < len(history) and history[position].fingerprint == fingerprint:
                reply = history[position]
            else:
                ours = False
                reply = Reply(fingerprint, known.get(fingerprint) if known else None)
            assistants.append(reply)
            if reply.ids is None:
                substituted.append(message)
                continue
            substituted.append({"role": "assistant", "content": _sentinel(len(spliced))})
            spliced.append(reply.ids)
        if len(assistants) < len(history):
            ours = False  # the harness left some turns out of its history
        return RenderedPrompt(self._ids(self._apply(substituted, tools), spliced), ours,
                              assistants)

    def _ids(self, text: str, spliced: list[list[int]]) -> list[int]:
        """The ids of rendered `text`: its pieces between sentinels encoded, the generated ids
        of each sentinel's reply in its place."""
        ids: list[int] = []
        start = 0
        for index, reply_ids in enumerate(spliced):
            sentinel = _sentinel(index)
            at = text.index(sentinel, start)
            ids += self.encode(text[start:at])
            ids += reply_ids
            # The template closes the turn itself; the generated end-of-turn id is that token.
            if reply_ids and reply_ids[-1] in self.end_of_turn_ids:
                ids.pop()
            start = at + len(sentinel)
        ids += self.encode(text[start:])
        return ids

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if self._compiled is not None:
            # What apply_chat_template renders, without its per-call copying of every message
            # (three quarters of its 0.4 ms on an eight-turn chat).
            return str(self._compiled.render(messages=messages, tools=tools or None,
                                             add_generation_prompt=True, **self._special))
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if self.template is not None:
            kwargs["chat_template"] = self.template
        if tools:
            kwargs["tools"] = tools
        return str(self.tokenizer.apply_chat_template(messages, **kwargs))
