import json

import pytest
import torch
from typer.testing import CliRunner

from vlrl.data import Sample
from vlrl.eval.select import Band, RolloutStore, item_stats, rollout_and_score, select, summarise
from vlrl.rollout import Request, SamplingParams, Trajectory

# correct responses out of 8 per item
CORRECT = {"a": 8, "b": 0, "c": 1, "d": 7, "e": 4}


def _sample(sid):
    return Sample(id=sid, task=f"t/{sid in 'ab'}", messages=[{"role": "user", "content": "What is 1 + 2?"}],
                  answer="3", reward="number")


class ScriptedEngine:
    """Item x answers right in its first CORRECT[x] samples, wrong in the rest."""

    weight_version = 0

    def __init__(self):
        self.calls = 0

    def encode(self, sample):
        return Request(sample=sample, prompt_ids=[1, 2, 3])

    def generate(self, requests, sampling):
        self.calls += 1
        out = []
        for g, request in enumerate(requests):
            for j in range(sampling.n):
                text = "<answer>3</answer>" if j < CORRECT[request.sample.id] else "<answer>4</answer>"
                out.append(Trajectory(sample=request.sample, prompt_ids=torch.tensor([1, 2, 3]),
                                      response_ids=torch.tensor([5]), loss_mask=torch.ones(1, dtype=torch.long),
                                      behaviour_logp=torch.zeros(1), response_text=text, group_index=g))
        return out


def test_selection_keeps_exactly_the_items_in_the_band(tmp_path):
    samples = [_sample(x) for x in "abcde"]
    engine, store = ScriptedEngine(), RolloutStore(tmp_path / "rollouts.jsonl")
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=8)
    rollouts, generated, failures = rollout_and_score(engine, samples, sampling, store, model="m", batch_prompts=2)
    assert (generated, failures, engine.calls) == (5, 0, 3)
    assert rollouts["c"].rewards == [1.0] + [0.0] * 7
    # mean reward in [0.1, 0.9]: a (8/8 = 1) too easy, b (0/8) too hard; c 0.125, d 0.875, e 0.5 kept
    kept, stats = select(samples, rollouts, Band(min_mean_reward=0.1, max_mean_reward=0.9))
    assert [s.id for s in kept] == ["c", "d", "e"]
    assert [s.verdict for s in stats] == ["too_easy", "too_hard", "keep", "keep", "keep"]
    # gap with k = 4: pass@4 = 1 − C(8 − c, 4) / C(8, 4); C(8, 4) = 70
    #   c: 1 − C(7,4)/70 = 1 − 35/70 = 0.5,     gap 0.5 − 0.125 = 0.375 (< 0.4: dropped)
    #   d: 1 (8 − 7 < 4),                        gap 1 − 0.875 = 0.125  (dropped)
    #   e: 1 − C(4,4)/70 = 69/70 = 0.98571,      gap 0.98571 − 0.5 = 0.48571 (kept)
    kept, stats = select(samples, rollouts, Band(min_mean_reward=0.1, max_mean_reward=0.9, min_gap=0.4, k=4))
    assert [s.id for s in kept] == ["e"]
    by_id = {s.id: s for s in stats}
    assert by_id["c"].pass_at_k == pytest.approx(0.5) and by_id["c"].gap == pytest.approx(0.375)
    assert by_id["e"].pass_at_k == pytest.approx(69 / 70) and by_id["d"].verdict == "small_gap"
    summary = summarise(stats)
    assert summary["verdicts"] == {"too_easy": 1, "too_hard": 1, "small_gap": 2, "keep": 1}
    assert summary["kept_pass_at_1"] == pytest.approx(0.5)


def test_the_store_is_reused_and_keyed_by_model_and_sampling(tmp_path):
    samples = [_sample(x) for x in "abc"]
    path = tmp_path / "rollouts.jsonl"
    engine = ScriptedEngine()
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    rollout_and_score(engine, samples, sampling, RolloutStore(path), model="m")
    reopened = RolloutStore(path)  # a later selection: everything comes from the file
    rollouts, generated, _ = rollout_and_score(engine, samples, sampling, reopened, model="m")
    assert generated == 0 and engine.calls == 1 and rollouts["a"].rewards == [1.0] * 4
    assert reopened.item_stats("m", rollouts["a"].sampling)["c"] == (4, 1, 0.25)
    _, generated, _ = rollout_and_score(engine, samples, SamplingParams(n=4, temperature=0.7, max_new_tokens=8),
                                        reopened, model="m")
    assert generated == 3  # another temperature: not the same rollouts
    _, generated, _ = rollout_and_score(engine, samples, sampling, reopened, model="other-checkpoint")
    assert generated == 3
    path.write_text(path.read_text() + "{broken\n")
    with pytest.raises(ValueError, match=r"rollouts.jsonl:\d+: not a rollout record"):
        RolloutStore(path)


def test_item_stats_checks_k():
    with pytest.raises(ValueError, match="k = 9 must be in 1..8"):
        item_stats(_sample("a"), [1.0] * 8, [1.0] * 8, 9)


def test_select_command_on_a_tiny_model(tmp_path):
    from vlrl.cli import app

    runner = CliRunner()
    runner.invoke(app, ["data", "gen", "arith", "--n", "6", "--out", str(tmp_path / "data")])
    args = ["data", "select", "--data", str(tmp_path / "data" / "train.jsonl"), "--model", "tiny-qwen2", "--n", "2",
            "--max-new-tokens", "4", "--out", str(tmp_path / "sel"), "--min-mean-reward", "0", "--max-mean-reward", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "sel" / "summary.json").read_text())
    assert summary["items"] == 6 and summary["verdicts"] == {"keep": 6} and summary["generated"] == 6
    assert len((tmp_path / "sel" / "stats.jsonl").read_text().splitlines()) == 6
    assert len((tmp_path / "sel" / "selected.jsonl").read_text().splitlines()) == 6
    again = runner.invoke(app, args)  # the second selection reuses the store
    assert again.exit_code == 0 and json.loads((tmp_path / "sel" / "summary.json").read_text())["generated"] == 0


def test_select_for_training_keeps_the_band_and_logs_it(tmp_path):
    from vlrl.config import RolloutConfig, SelectConfig
    from vlrl.report import MetricsLogger
    from vlrl.train.select import select_for_training

    samples = [_sample(x) for x in "abcde"]
    logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True, progress="off")
    kept, summary = select_for_training(ScriptedEngine(), samples, SelectConfig(enabled=True), RolloutConfig(),
                                        logger=logger, run_dir=tmp_path, model="m")
    assert [s.id for s in kept] == ["c", "d", "e"]  # 1, 7 and 4 of 8 correct: inside [0.1, 0.9]
    assert summary["verdicts"] == {"too_easy": 1, "too_hard": 1, "keep": 3}
    record = logger.records[-1]
    assert record["stage"] == "rl/select"
    assert (record["select/items"], record["select/kept"], record["select/too_easy"], record["select/too_hard"]) == (5, 3, 1, 1)
    assert len((tmp_path / "select_rollouts.jsonl").read_text().splitlines()) == 5
    # max_prompts: only the first 2 are scored (a: too easy, b: too hard) — nothing left is a clear error
    with pytest.raises(ValueError, match="none of the 2 prompts fell inside the band"):
        select_for_training(ScriptedEngine(), samples, SelectConfig(enabled=True, max_prompts=2), RolloutConfig(),
                            logger=logger, run_dir=tmp_path, model="m")


def test_select_k_above_n_is_refused():
    from vlrl.config import SelectConfig

    with pytest.raises(ValueError, match="select.k = 9 exceeds select.n = 8"):
        SelectConfig(k=9)


def test_vlrl_rl_selects_its_prompts_with_one_switch(tmp_path):
    from vlrl.cli import app

    run = tmp_path / "run"
    # an untrained model scores 0 everywhere: with the lower bound open (0) every scored prompt is kept
    result = CliRunner().invoke(app, [
        "rl", f"out={run}", "model.path=tiny-qwen2", "data.suite=arith", "data.tasks=[add]", "data.n_train=16",
        "data.n_test=4", "train.steps=1", "train.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
        "eval.samples=2", "eval.max_new_tokens=4", "select.enabled=true", "select.n=2", "select.max_prompts=6",
        "select.min_mean_reward=0", "report.html=false"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    selected = [r for r in records if r["stage"] == "rl/select"]
    assert len(selected) == 1 and (selected[0]["select/items"], selected[0]["select/kept"]) == (6, 6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train"]["select"]["verdicts"] == {"keep": 6} and summary["train"]["select"]["n"] == 2


def test_selection_counts_a_right_answer_in_a_broken_form_as_wrong_unless_lenient(tmp_path):
    """Strict (RL's algo.strict_reward, the default): `<answer>3</answer>3</answer>` is right by the verifier but not
    well-formed, so it scores 0 and is not correct — the prompt looks as hard as training will find it."""

    class Broken(ScriptedEngine):
        def generate(self, requests, sampling):
            out = super().generate(requests, sampling)
            for t in out:
                t.response_text = t.response_text.replace("<answer>3</answer>", "<answer>3</answer>3</answer>")
            return out

    samples = [_sample("e")]
    samples[0].answer_format = "answer"  # one ended <answer>…</answer> and nothing after it
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=8)
    strict, _, _ = rollout_and_score(Broken(), samples, sampling, RolloutStore(tmp_path / "a.jsonl"), model="m")
    lenient, _, _ = rollout_and_score(Broken(), samples, sampling, RolloutStore(tmp_path / "b.jsonl"), model="m",
                                      strict=False)
    assert strict["e"].correct == [0.0] * 8 and strict["e"].rewards == [0.0] * 8
    assert lenient["e"].correct == [1.0] * 4 + [0.0] * 4 and lenient["e"].rewards[:4] == [1.0] * 4

