"""samples.jsonl: the first prompts of every task, every batch of the same requests, images written once."""


import torch

from vlrl.data import generate
from vlrl.report.samples import SampleLog, read_sample_rows
from vlrl.rollout.types import Status, Trajectory


def _batch(samples, n):
    return [Trajectory(sample=s, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([5, 6]),
                       loss_mask=torch.ones(2, dtype=torch.long), behaviour_logp=torch.zeros(2), group_index=g,
                       response_text=f"<answer>{g}.{k}</answer>", reward=0.5, reward_parts={"accuracy": 0.0},
                       status=Status.TRUNCATED)
            for g, s in enumerate(samples) for k in range(n)]


def test_writes_the_first_prompts_of_each_task(tmp_path):
    samples = generate("shapes", 6, split="test", tasks=["count", "color"])  # tasks alternate: count, color, ...
    log = SampleLog(tmp_path, per_task=2, per_prompt=2)
    written = log.write("eval/sft", 0, [("greedy", _batch(samples, 1)), ("t=1", _batch(samples, 3))])
    rows, problems = read_sample_rows(tmp_path)
    # 4 prompts (2 per task, groups 0-3): 1 greedy + 2 of the 3 sampled (per_prompt) each = 12 rows
    assert written == 12 and len(rows) == 12 and problems == []
    assert sorted({r["group"] for r in rows}) == [0, 1, 2, 3]
    assert [r["sampling"] for r in rows[:4]] == ["greedy"] * 4
    first = rows[0]
    assert first["status"] == "truncated" and first["length"] == 2 and first["reward_parts"] == {"accuracy": 0.0}
    assert first["prompt"].startswith("<image>") and first["images"] == [f"samples/{samples[0].id}_0.png"]
    assert len(list((tmp_path / "samples").glob("*.png"))) == 4  # one image per prompt, written once
    (tmp_path / "samples.jsonl").write_text((tmp_path / "samples.jsonl").read_text() + "[1, 2]\n")
    rows, problems = read_sample_rows(tmp_path)
    assert len(rows) == 12 and problems == [f"{tmp_path / 'samples.jsonl'}:13: skipped (not a JSON object)"]


def test_nothing_to_write(tmp_path):
    assert SampleLog(tmp_path, per_task=0).write("rl", 1, [("x", _batch(generate("shapes", 1), 1))]) == 0
    assert SampleLog(tmp_path).write("rl", 1, [("x", [])]) == 0
    assert not (tmp_path / "samples.jsonl").exists()
