"""The sample table (newest episodes) and one sample's view: turns, commands, tokens."""

from __future__ import annotations

import re
from typing import Any

from services.rollout.dashboard.record import RunRecord

EPISODE_COLUMNS = ("sample_id", "group_id", "task_id", "engine", "dp_rank", "turns",
                   "prompt_tokens", "response_tokens", "reward", "verdict", "truncated",
                   "aborted", "eval")
_COMMAND = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.DOTALL)


def recent_episodes(record: RunRecord, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` finished episodes, newest first, with whether their detail is kept."""
    rows = []
    for e in reversed(record.of_kind("rollout.episode")):
        row = {k: e.attrs.get(k) for k in EPISODE_COLUMNS}
        row.update(start=e.start, end=e.end, weight_version=e.weight_version,
                   has_detail=str(e.attrs.get("sample_id")) in record.episodes)
        rows.append(row)
        if len(rows) >= limit:
            break
    return rows


def sample_view(episode: dict[str, Any]) -> dict[str, Any]:
    """An episode's detail shaped for the page: turns with their commands, and its tokens
    as `{text, loss, logprob}` (text falls back to the id when no token text was kept)."""
    turns = []
    for turn in episode.get("turns") or []:
        assistant = str(turn.get("assistant", turn.get("assistant_text", "")))
        commands = turn.get("commands") or [c.strip() for c in _COMMAND.findall(assistant)]
        turns.append({"assistant": assistant, "commands": commands,
                      "observation": str(turn.get("observation", ""))})
    tokens = episode.get("tokens") or {}
    ids = tokens.get("ids") or []
    mask = tokens.get("loss_mask") or [0] * len(ids)
    logprobs = tokens.get("logprobs") or [None] * len(ids)
    text = episode.get("token_text") or [f"<{i}>" for i in ids]
    return {
        "sample_id": episode.get("sample_id"), "group_id": episode.get("group_id"),
        "task_id": episode.get("task_id"), "reward": episode.get("reward"),
        "verdict": episode.get("verdict"), "turns": turns,
        "tokens": [{"text": str(t), "loss": bool(m), "logprob": lp}
                   for t, m, lp in zip(text, mask, logprobs, strict=False)],
    }
