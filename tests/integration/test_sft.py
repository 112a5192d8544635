"""`riptide sft` end to end: oracle episodes in real local sandboxes, then the megatron trainer
lowers the NLL of the assistant tokens, and the exported folder loads with transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.sandbox.warm_start import loss_spans
from services.testing.engine_process import tiny_model_path

REPO = Path(__file__).resolve().parents[2]
TASKS = ("count-lines", "write-hello")


def _assistant_nll(model_dir: Path, rows: list[dict[str, list[int]]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    total = count = 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            token_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(row["loss_mask"][1:], dtype=torch.float32)
            total += float(-(token_lp * mask).sum())
            count += float(mask.sum())
    return total / count


@pytest.mark.slow
def test_sft_lowers_the_assistant_loss_and_exports_a_loadable_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in TASKS:
        (tasks / name).symlink_to(REPO / "tasks" / "starter" / "train" / name)
    base, out = tiny_model_path(), tmp_path / "sft"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "sft", "--tasks", str(tasks), "--model", str(base),
         "--protocol", "markdown_bash", "--out", str(out), "--steps", "8", "--lr", "3e-3",
         "--batch-size", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 8 and result["num_tasks"] == 2 and result["epochs"] == 8.0
    losses = result["losses"]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses

    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [row["task"] for row in rows] == list(TASKS)
    tokenizer = AutoTokenizer.from_pretrained(base)
    for row, command in zip(rows, ("wc -l < /app/data.txt > /app/count.txt",
                                   "echo hello > /app/hello.txt"), strict=True):
        spans = loss_spans(row["loss_mask"])
        texts = [tokenizer.decode(row["ids"][a:b]) for a, b in spans]
        assert texts == [f"THOUGHT: I do what the task asks with one command.\n```bash\n"
                         f"{command}\n```<|im_end|>",
                         "THOUGHT: Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n"
                         "```<|im_end|>"]
        prompt = tokenizer.decode(row["ids"][:spans[0][0]])
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("assistant\n")
        # The observation between the turns is the sandbox's real answer to the command.
        observation = tokenizer.decode(row["ids"][spans[0][1]:spans[1][0]])
        assert f"$ {command}\n[exit code 0]" in observation

    hf = Path(result["hf_path"])
    assert hf == out / "hf" and (hf / "model.safetensors").is_file()
    assert Path(result["checkpoint"]).parent == out / "checkpoints"
    assert (Path(result["checkpoint"]) / "model.pt").is_file()
    trained, untrained = _assistant_nll(hf, rows), _assistant_nll(base, rows)
    assert trained < 0.7 * untrained, (trained, untrained)
