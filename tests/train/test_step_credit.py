import json
from types import SimpleNamespace

import pytest
import torch

from vlrl.data import generate
from vlrl.models.tokenizer import train_tokenizer
from vlrl.train.step_credit import (
    StepCreditOptions,
    parse_options,
    parse_response_plan,
    shape_step_credit,
)

GOLD = [{"action_id": 3, "action_name": "find a mug"}, {"action_id": 16, "action_name": "pick up the mug"},
        {"action_id": 9, "action_name": "find a fridge"}]
HEAD = '{"visual_state_description": "fridge open; hand empty", "reasoning_and_reflection": "no door to open", '


@pytest.fixture(scope="module")
def policy():
    """One tiny Qwen2-VL for the module (the tests below do not depend on its exact weights)."""
    from vlrl.models import load_policy

    return load_policy("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def tokenizer():
    samples = generate("embodied", 30, split="spans", image_size=56)
    return train_tokenizer([s.response for s in samples] + [s.prompt_text() for s in samples], vocab_size=600)


def _response(plan, tail="]}"):
    return HEAD + '"language_plan": "take the mug", "executable_plan": [' + ", ".join(json.dumps(s) for s in plan) + tail


def _pieces(tokenizer, text, every=3):
    """ids of ``text`` encoded in 3-character pieces: the same text, a non-canonical tokenisation."""
    return [i for k in range(0, len(text), every) for i in tokenizer(text[k:k + every], add_special_tokens=False)["input_ids"]]


def _trajectory(tokenizer, text=None, ids=None, success=False, answer=GOLD):
    ids = ids if ids is not None else tokenizer(text, add_special_tokens=False)["input_ids"]
    return SimpleNamespace(response_ids=torch.tensor(ids), sample=SimpleNamespace(answer=answer, id="s"),
                           reward=float(success), accuracy=float(success))


def _decoded(tokenizer, trajectory, index, k):
    ids = trajectory.response_ids[: index.shape[0]]
    return tokenizer.decode([int(ids[t]) for t in (index[: len(ids)] == k).nonzero().flatten()]).strip()


@pytest.mark.parametrize("canonical", [True, False])
def test_parse_response_plan_maps_values_to_tokens(tokenizer, canonical):
    text = _response(GOLD) + "<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if canonical else _pieces(tokenizer, text)
    plan = parse_response_plan(tokenizer, ids)
    assert plan.path == ("tokenizer" if canonical else "prefix_decode") and plan.complete
    assert plan.ids == [3, 16, 9] and plan.names == ["find a mug", "pick up the mug", "find a fridge"]
    for k, step in enumerate(GOLD):
        assert tokenizer.decode([ids[t] for t in plan.id_tokens[k]]).strip() == str(step["action_id"])
        assert tokenizer.decode([ids[t] for t in plan.name_tokens[k]]).strip() == step["action_name"]
        assert plan.tokens(k, "semantic") == sorted(plan.id_tokens[k] + plan.name_tokens[k])


def test_parse_response_plan_on_malformed_output(tokenizer):
    cut = _response(GOLD, tail="")[:-12]  # cut inside the last step
    plan = parse_response_plan(tokenizer, tokenizer(cut, add_special_tokens=False)["input_ids"])
    assert plan.ids == [3, 16] and not plan.complete
    unquoted = _response(GOLD).replace('"pick up the mug"', "pick up the mug")  # step 2 is not JSON
    assert parse_response_plan(tokenizer, tokenizer(unquoted, add_special_tokens=False)["input_ids"]).ids == [3]
    for garbage in ("I will find the mug.", '{"executable_plan": []}', ""):
        assert parse_response_plan(tokenizer, tokenizer(garbage, add_special_tokens=False)["input_ids"]) is None


def test_options_are_validated_by_name():
    assert parse_options({"signal": "rule", "match": "lcs"}).match == "lcs"
    with pytest.raises(ValueError, match="step_credit option 'wieght': unknown option"):
        parse_options({"wieght": 1.0})
    with pytest.raises(ValueError, match="step_credit option 'alpha'"):
        parse_options({"alpha": 1.5})
    with pytest.raises(ValueError, match="unknown step matcher 'fuzzy'"):
        parse_options({"match": "fuzzy"})
    missing = [name for name, f in StepCreditOptions.model_fields.items() if not (f.description and len(f.description) > 10)]
    assert not missing


def test_rule_credit_on_a_batch(tokenizer):
    wrong = [GOLD[0], {"action_id": 17, "action_name": "pick up the potato"}, GOLD[2]]
    batch = [
        _trajectory(tokenizer, _response(GOLD), success=True),                              # all steps right
        _trajectory(tokenizer, ids=_pieces(tokenizer, _response(wrong))),                   # step 2 wrong, prefix-decoded
        _trajectory(tokenizer, "no plan at all"),                                           # parse failure
    ]
    T = max(len(t.response_ids) for t in batch)
    loss_mask = torch.zeros(3, T)
    for b, t in enumerate(batch):
        loss_mask[b, : len(t.response_ids)] = 1
    episode = torch.tensor([[0.5], [-0.5], [-0.5]]) * loss_mask  # A^E of a success and two failures
    options = parse_options({"signal": "rule", "match": "exact", "score_source": "action_id",
                             "credit_target": "action_id", "weight": 1.0})
    out = shape_step_credit(episode, loss_mask, batch, policy=SimpleNamespace(tokenizer=tokenizer), options=options)
    # A^S = +1 on the id tokens of right steps, −1 on wrong ones, 0 elsewhere and for the unparsed response
    for b, signs in ((0, [1, 1, 1]), (1, [1, -1, 1])):
        for k, sign in enumerate(signs):
            assert _decoded(tokenizer, batch[b], out.target_index[b], k) == str([GOLD, wrong][b][k]["action_id"])
            tokens = (out.target_index[b] == k).nonzero().flatten()
            assert out.step_advantages[b, tokens].tolist() == [float(sign)] * len(tokens)
            assert out.advantages[b, tokens].tolist() == pytest.approx([episode[b, 0].item() + sign] * len(tokens))
    outside = out.target_index < 0
    assert torch.equal(out.advantages[outside], episode[outside])  # scaffolding keeps A^E
    assert torch.equal(out.advantages[2], episode[2]) and out.record["parse_failures"] == 1
    assert out.metrics["parse_fail_frac"] == pytest.approx(1 / 3)
    assert out.record["prefix_decode"] == 1 and out.record["steps"] == 6 and out.record["correct_steps"] == 5
    # sign flips over action tokens: every right step of the failed response turned positive
    flips = out.record["flips"]
    right_tokens = sum(int((out.target_index[1] == k).sum()) for k in (0, 2))
    assert flips["failed"]["flips"] == right_tokens and flips["success"]["flips"] == 0
    assert flips["wrong_step"]["flips"] == 0 and flips["correct_step"]["flips"] == right_tokens
    assert out.record["step_scores"] == {"correct": [1.0] * 5, "wrong": [-1.0]}


def test_semantic_scoring_and_prefix_matching(tokenizer):
    renamed = [GOLD[0], {"action_id": 16, "action_name": "pick up the cup"}, GOLD[2]]  # right id, wrong name
    batch = [_trajectory(tokenizer, _response(renamed))]
    loss_mask = torch.ones(1, len(batch[0].response_ids))
    episode = torch.zeros_like(loss_mask)
    by_id = shape_step_credit(episode, loss_mask, batch, policy=SimpleNamespace(tokenizer=tokenizer),
                              options=parse_options({"match": "prefix", "score_source": "action_id"}))
    both = shape_step_credit(episode, loss_mask, batch, policy=SimpleNamespace(tokenizer=tokenizer),
                             options=parse_options({"match": "prefix", "score_source": "semantic"}))
    assert by_id.record["correct_steps"] == 3
    assert both.record["correct_steps"] == 1  # prefix: the name mismatch at step 2 ends the credit
    assert _decoded(tokenizer, batch[0], both.target_index[0], 1) == "16pick up the cup"  # id and name tokens
    # A^E = 0 everywhere: every non-zero A is new signal, none a flip
    assert both.record["flips"]["all"]["flips"] == 0 and both.record["flips"]["all"]["new_signal"] > 0


def test_forward_proxy_and_stepopsd_with_a_tiny_teacher(policy):
    from vlrl.models import collate, response_logprobs
    from vlrl.rollout import HFEngine

    samples = generate("embodied", 2, seed=1, tasks=["pick_place"], list_actions=False)
    engine = HFEngine(policy)
    tokenizer = policy.tokenizer
    batch = []
    for sample in samples:
        request = engine.encode(sample)
        ids = tokenizer(sample.response, add_special_tokens=False)["input_ids"]
        batch.append(SimpleNamespace(sample=sample, prompt_ids=torch.tensor(request.prompt_ids), vision=request.vision,
                                     response_ids=torch.tensor(ids), reward=0.0, accuracy=0.0))
    T = max(len(t.response_ids) for t in batch)
    loss_mask = torch.zeros(2, T)
    for b, t in enumerate(batch):
        loss_mask[b, : len(t.response_ids)] = 1
    episode = torch.tensor([[-1.0], [1.0]]) * loss_mask
    options = parse_options({"signal": "forward_proxy", "injection": "stepopsd", "alpha": 0.5,
                             "score_source": "semantic", "credit_target": "semantic"})
    out = shape_step_credit(episode, loss_mask, batch, policy=policy, options=options, teacher_model=policy.model)
    target = out.target_index >= 0
    assert target.any() and torch.isfinite(out.advantages).all()
    assert torch.equal(torch.sign(out.advantages), torch.sign(episode))  # StepOPSD never flips
    assert torch.equal(out.advantages[~target], episode[~target])
    ratio = out.advantages[target] / episode[target]
    assert ((ratio >= 0.5 - 1e-6) & (ratio <= 1.5 + 1e-6)).all() and (ratio != 1).any()
    # Δ by hand for response 0: the teacher context is the prompt + the reference plan
    from vlrl.data.sample import load_image
    from vlrl.data.tasks.embodied import with_reference

    sample = samples[0]
    teacher_prompt = policy.adapter.encode_prompt(with_reference(sample.messages, sample.answer),
                                                    [load_image(i) for i in sample.images])
    def logp(prompt_ids, vision):
        tokens = collate([prompt_ids], [batch[0].response_ids], [vision], pad_token_id=policy.pad_token_id)
        with torch.no_grad():
            return response_logprobs(policy.model, policy.adapter, tokens)[0][0]
    delta = logp(teacher_prompt.input_ids, teacher_prompt.vision) - logp(batch[0].prompt_ids, batch[0].vision)
    additive = shape_step_credit(episode, loss_mask, batch, policy=policy, teacher_model=policy.model,
                                 options=parse_options({"signal": "forward_proxy", "proxy": "contrast", "robust": False,
                                                        "score_source": "action_id", "credit_target": "action_id"}))
    k0 = (additive.target_index[0] == 0).nonzero().flatten()
    assert additive.step_advantages[0, k0[0]] == pytest.approx(torch.tanh(delta[k0].mean()).item(), abs=1e-4)


# ----------------------------------------------------------------------------------------------- in the recipe
class ScriptedEngine:
    """Speaks the Engine protocol; answers each prompt with fixed variants of its gold response (right, one wrong
    step, cut off, no plan), so that a tiny random model still yields parseable plans with mixed rewards."""

    def __init__(self, policy):
        from vlrl.rollout import HFEngine

        self.inner, self.policy, self.weight_version = HFEngine(policy), policy, 0

    def encode(self, sample):
        return self.inner.encode(sample)

    def update_weights(self, *, version, state_dict=None):
        self.weight_version = version

    def generate(self, requests, sampling):
        from vlrl.rollout import Status, Trajectory

        out = []
        eos = self.policy.eos_token_ids[0]
        for g, request in enumerate(requests):
            gold = request.sample.response
            wrong = gold.replace('"action_id": ', '"action_id": 2', 1)  # the first step's id gets a leading 2
            variants = [gold, wrong, gold[: len(gold) * 2 // 3], "no plan"][: sampling.n]
            for text in variants:
                ids = self.policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
                n = len(ids)
                out.append(Trajectory(sample=request.sample, prompt_ids=torch.tensor(request.prompt_ids),
                                      response_ids=torch.tensor(ids), loss_mask=torch.ones(n, dtype=torch.long),
                                      behaviour_logp=torch.full((n,), -1.0), vision=request.vision, images=request.images,
                                      weight_version=self.weight_version, status=Status.COMPLETED, response_text=text,
                                      group_index=g))
        return out


def _rl(policy, tmp_path, options, steps=2):
    from vlrl.config import RLStage
    from vlrl.report import MetricsLogger
    from vlrl.train.loop import train_rl

    samples = generate("embodied", 4, seed=2, tasks=["pick_place"], list_actions=False, history_prob=0.0)
    stage = RLStage.model_validate({
        "rollout": {"n": 4, "max_new_tokens": 128}, "optim": {"lr": 1e-3},
        "train": {"steps": steps, "prompts_per_step": 2, "micro_batch_size": 8},
        "algo": {"advantage_shaping": [{"name": "step_credit", "options": options}]},
    })
    logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    train_rl(policy, ScriptedEngine(policy), samples, stage, logger=logger, seed=0)
    logger.close()
    changed = any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    return [r for r in logger.records if r["stage"] == "rl"], changed


def test_rule_credit_in_the_rl_recipe_writes_the_analysis(policy, tmp_path):
    from vlrl.report.step_credit import summarize

    records, changed = _rl(policy, tmp_path, {"signal": "rule", "match": "prefix", "heatmap_every": 2,
                                                "heatmap_rows": 2})
    assert changed and len(records) == 2
    last = records[-1]
    assert last["shaping/step_credit/parse_fail_frac"] == pytest.approx(0.25)  # "no plan" of each group
    assert 0 < last["shaping/step_credit/step_acc"] < 1  # the wrong first step (prefix: the rest is wrong too)
    assert "shaping/step_credit/sign_flip_frac/all" in last
    analysis = tmp_path / "step_credit"
    assert len((analysis / "step_credit.jsonl").read_text().splitlines()) == 2
    assert sorted(p.name for p in analysis.glob("heatmap_*.png")) == ["heatmap_step00002.png"]  # every 2nd step
    summary, notes = summarize(tmp_path)  # what the report's step-credit section shows
    assert summary.steps_logged == 2 and not notes and summary.signal == "rule"
    assert summary.totals["parse_failures"] == 4 and [name for name, _ in summary.heatmaps] == ["step00002"]


def test_forward_proxy_in_the_rl_recipe(policy, tmp_path):
    records, changed = _rl(policy, tmp_path, {"signal": "forward_proxy", "teacher": "reference",
                                                "proxy": "residual_contrast", "heatmap_every": 0}, steps=1)
    assert changed
    metrics = records[-1]
    assert 0 <= metrics["shaping/step_credit/gate_mean"] <= 1
    assert all(isinstance(v, float) and v == v for k, v in metrics.items() if k.startswith("shaping/"))
    assert not list((tmp_path / "step_credit").glob("heatmap_*.png"))
