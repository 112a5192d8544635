"""The gateway's chat rendering: our own replies are spliced in as the engine generated them."""

from __future__ import annotations

import copy
from typing import Any

from services.common.tiny_model import build_tokenizer
from services.sandbox.gateway.chat_render import ChatRenderer, Reply, reply_fingerprint

TOKENIZER = build_tokenizer()
EOT = TOKENIZER.eos_token_id


def renderer() -> ChatRenderer:
    return ChatRenderer(TOKENIZER, TOKENIZER.chat_template, {EOT})


def first_turn() -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_a_first_call_is_the_templates_own_rendering() -> None:
    rendered = renderer().render(first_turn(), None, [])
    text = TOKENIZER.apply_chat_template(first_turn(), tokenize=False,
                                         add_generation_prompt=True)
    assert rendered.ids == TOKENIZER.encode(text, add_special_tokens=False)
    assert rendered.history_is_ours


def test_a_reply_sent_back_is_spliced_as_generated_not_re_encoded() -> None:
    # 0xC3 alone is not UTF-8: it decodes to U+FFFD, which re-encodes as three other bytes.
    generated = [0xC3, ord("A"), EOT]
    text = TOKENIZER.decode(generated[:-1], skip_special_tokens=True)
    assert TOKENIZER.encode(text, add_special_tokens=False) != generated[:-1]
    chat = renderer()
    prompt = chat.render(first_turn(), None, []).ids
    replies = [Reply(reply_fingerprint(text, None), generated)]
    messages = [*first_turn(), {"role": "assistant", "content": text},
                {"role": "user", "content": "more"}]
    rendered = chat.render(messages, None, replies)
    assert rendered.history_is_ours
    so_far = prompt + generated
    assert rendered.ids[:len(so_far)] == so_far
    tail = TOKENIZER.decode(rendered.ids[len(so_far):], skip_special_tokens=False)
    assert tail == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


def test_a_reply_cut_at_max_tokens_is_closed_by_the_template() -> None:
    generated = [ord("o"), ord("k")]  # no end-of-turn: the engine stopped at the length cap
    chat = renderer()
    prompt = chat.render(first_turn(), None, []).ids
    messages = [*first_turn(), {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "go on"}]
    rendered = chat.render(messages, None, [Reply(reply_fingerprint("ok", None), generated)])
    assert rendered.ids[:len(prompt) + 3] == prompt + generated + [EOT]


def test_an_edited_or_dropped_reply_is_not_our_history() -> None:
    chat = renderer()
    replies = [Reply(reply_fingerprint("ok", None), [ord("o"), ord("k"), EOT])]
    edited = [*first_turn(), {"role": "assistant", "content": "OK!"},
              {"role": "user", "content": "go on"}]
    assert not chat.render(edited, None, replies).history_is_ours
    summarized = [*first_turn(), {"role": "user", "content": "summary of what happened"}]
    assert not chat.render(summarized, None, replies).history_is_ours


def test_tool_calls_are_matched_by_name_and_arguments_not_their_spelling() -> None:
    ours = reply_fingerprint(None, [{"function": {"name": "run", "arguments": '{"b": 1, "a": 2}'}}])
    sent_back = reply_fingerprint("", [{"id": "x", "type": "function", "function": {
        "name": "run", "arguments": '{"a":2,"b":1}'}}])
    assert ours == sent_back
    assert ours != reply_fingerprint("", [{"function": {"name": "run", "arguments": '{"a":3}'}}])


def template_ids(messages: list[dict[str, str]]) -> list[int]:
    """The template's own rendering, encoded whole (the byte-level tokenizer encodes text the
    same whole or in pieces)."""
    text = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_a_long_chat_of_our_replies_renders_exactly_the_templates_tokens() -> None:
    # More turns than there are ready-made sentinels; some replies were cut at max_tokens
    # (no end-of-turn id), which the template closes.
    chat, messages, history = renderer(), first_turn(), []
    for turn in range(80):
        text = f"reply {turn}"
        ids = [ord(c) for c in text] + ([] if turn % 3 == 0 else [EOT])
        history.append(Reply(reply_fingerprint(text, None), ids))
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"observation {turn}"}]
    rendered = chat.render(messages, None, history)
    assert rendered.history_is_ours and rendered.assistants == history
    assert rendered.ids == template_ids(messages)
    # the same again from the piece cache, and from a renderer with none
    assert chat.render(messages, None, history).ids == rendered.ids
    assert renderer().render(messages, None, history).ids == rendered.ids


def test_a_rewritten_history_renders_the_edited_turn_and_keeps_the_others_generated() -> None:
    generated = [0xC3, ord("A"), EOT]  # re-encodes otherwise: only splicing keeps these ids
    text = TOKENIZER.decode(generated[:-1], skip_special_tokens=True)
    known = {reply_fingerprint("first", None): [*map(ord, "first"), EOT],
             reply_fingerprint(text, None): generated}
    history = [Reply(fingerprint, ids) for fingerprint, ids in known.items()]
    messages = [*first_turn(), {"role": "assistant", "content": "first, edited"},
                {"role": "user", "content": "go"}, {"role": "assistant", "content": text},
                {"role": "user", "content": "on"}]
    chat = renderer()
    rendered = chat.render(messages, None, history, known)
    assert not rendered.history_is_ours
    assert [r.ids for r in rendered.assistants] == [None, generated]
    # the edited turn as the template renders it, up to the opening of our reply
    prefix = template_ids(messages[:4])
    assert rendered.ids[:len(prefix)] == prefix
    assert rendered.ids[len(prefix):len(prefix) + 3] == generated
    assert rendered.ids[len(prefix) + 3:] == TOKENIZER.encode(
        "\n<|im_start|>user\non<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_a_reply_decodes_as_the_tokenizers_own_decode() -> None:
    im_start = TOKENIZER.convert_tokens_to_ids("<|im_start|>")
    for ids in ([ord("o"), ord("k"), EOT], [0xC3, ord("A"), im_start, 1, EOT], [], [EOT]):
        expected = TOKENIZER.decode([i for i in ids if i != EOT], skip_special_tokens=True)
        assert renderer().decode_reply(ids) == expected


def test_a_tokenizer_with_its_own_decode_is_decoded_by_it() -> None:
    class Shouting(type(TOKENIZER)):  # type: ignore[misc]
        def decode(self, ids: Any, **kwargs: Any) -> Any:
            return super().decode(ids, **kwargs).upper()

    shouting = copy.copy(TOKENIZER)
    shouting.__class__ = Shouting
    chat = ChatRenderer(shouting, TOKENIZER.chat_template, {EOT})
    assert chat.decode_reply([ord("o"), ord("k"), EOT]) == "OK"
