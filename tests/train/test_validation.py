"""``eval.every`` / ``eval.samples_table`` (`vlrl.train.validation`): held-out accuracy during SFT and RL in
metrics.jsonl, the report's curves and the trackers, as verl's test_freq / log_val_generations."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from cli_runner import in_process  # tests/ is on sys.path (the test packages' root)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "src" / "vlrl" / "configs"


def _cli(*args: str) -> None:
    in_process(*args)  # the vlrl app in this process (tests/cli_runner.py): the checks read the files it writes


@pytest.mark.e2e
def test_rl_validates_every_n_steps_into_metrics_report_and_tensorboard(tiny_vlm_dir, tmp_path):
    """5 steps, every 2: ``val/rl`` at 0 (the initial evaluation), 2, 4 (evaluated by the loop) and 5 (the final one);
    each with the held-out metrics; the report draws them; TensorBoard holds the samples table at each."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    _cli("rl", "--config", str(CONFIGS / "shapes_grpo.yaml"), f"model.path={tiny_vlm_dir}", "train.steps=5",
         "train.prompts_per_step=2", "rollout.n=2", "train.log_every=1", "data.n_train=8", "data.n_test=3", "eval.samples=2",
         "eval.every=2", "eval.samples_table=2", "report.sinks=[tensorboard]", f"out={out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r["stage"] == "val/rl"]
    assert [r["step"] for r in validation] == [0, 2, 4, 5]
    for r in validation:
        assert {"accuracy/mean", "greedy/mean", "pass@2/mean", "reward/mean"} <= set(r) and r["eval/prompts"] == 3
    initial, final = (next(r for r in records if r["stage"] == s) for s in ("eval/initial", "eval/final"))
    assert validation[0]["greedy/mean"] == initial["greedy/mean"] and validation[-1]["greedy/mean"] == final["greedy/mean"]
    # the loop's evaluations sit between the training steps
    order = [(r["stage"], r["step"]) for r in records if r["stage"] in ("rl", "val/rl")]
    assert order.index(("val/rl", 2)) == order.index(("rl", 2)) + 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {(s["stage"], s["step"]) for s in samples if s["stage"] == "val/rl"} == {("val/rl", 2), ("val/rl", 4)}
    html = (out / "report.html").read_text()
    assert 'data-title="Held-out accuracy during training"' in html and "val/rl" in html

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "val" / "rl"), size_guidance={"tensors": 0})
    events.Reload()
    tables = events.Tensors("samples/text_summary")
    assert [t.step for t in tables] == [0, 2, 4, 5]
    text = tables[1].tensor_proto.string_val[0].decode()
    assert text.startswith("| task | id | prompt | response | answer | reward |") and text.count("\n| shapes/") == 2


@pytest.mark.e2e
def test_async_rl_validates_with_the_steps_weights(tiny_vlm_dir, tmp_path):
    """``rollout.mode=async`` (η = 1, the in-process threaded engine): 5 steps, every 2 — ``val/rl`` at 0, 2, 4, 5 as in
    a synchronous run, each loop evaluation between its step and the next, every response of it sampled by the
    weights of its step (``weight_version`` in samples.jsonl), and the training rows still asynchronous ones."""
    out = tmp_path / "run"
    _cli("rl", "--config", str(CONFIGS / "shapes_grpo.yaml"), f"model.path={tiny_vlm_dir}", "train.steps=5",
         "train.prompts_per_step=2", "rollout.n=2", "train.log_every=1", "data.n_train=8", "data.n_test=3", "eval.samples=1",
         "eval.every=2", "rollout.mode=async", "staleness.eta=1", f"out={out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["stage"] == "val/rl"] == [0, 2, 4, 5]
    order = [(r["stage"], r["step"]) for r in records if r["stage"] in ("rl", "val/rl")]
    assert order.index(("val/rl", 2)) == order.index(("rl", 2)) + 1
    assert order.index(("val/rl", 4)) == order.index(("rl", 4)) + 1
    assert all("staleness/mean" in r for r in records if r["stage"] == "rl") and \
        len([r for r in records if r["stage"] == "rl"]) == 5
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    versions = {}
    for s in samples:
        if s["stage"] == "val/rl":
            versions.setdefault(s["step"], set()).add(s["weight_version"])
    assert versions == {2: {2}, 4: {4}}


def test_the_wandb_table_holds_prompts_responses_and_rewards(monkeypatch, tmp_path):
    """The W&B sink logs ``eval.samples_table`` as a ``wandb.Table`` under ``<stage>/samples`` (a stand-in module
    records what reaches wandb: no account, no network)."""
    logged: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.Table = lambda columns, data: ("Table", tuple(columns), data)
    fake.init = lambda **kwargs: types.SimpleNamespace(log=logged.append, define_metric=lambda *a, **k: None,
                                                        finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from vlrl.report import MetricsLogger
    from vlrl.report.sinks import make_sink

    logger = MetricsLogger(None, quiet=True, sinks=[make_sink("wandb", tmp_path, run_name="r")])
    logger.log("val/rl", 2, {"accuracy/mean": 0.5})
    logger.table("val/rl", 2, ["prompt", "response", "reward"], [{"prompt": "<image>How many?", "response": "3",
                                                                  "reward": 1.0}])
    assert logged[-1] == {"val/rl/samples": ("Table", ("prompt", "response", "reward"), [["<image>How many?", "3", 1.0]]),
                          "val/rl/step": 2}


def test_evaluation_over_ranks_equals_one_process():
    """Under torchrun each rank evaluates an equal share (padded with repeats, which are dropped) and the shares are
    gathered: with greedy decoding the result is the one-process result. Two ranks are played in one process: rank
    0's gather returns rank 1's share, computed the same way."""
    from vlrl.config import EvalConfig
    from vlrl.data import generate
    from vlrl.eval import evaluate
    from vlrl.eval.evaluate import _score
    from vlrl.models import load_policy
    from vlrl.rollout.hf_engine import HFEngine

    engine = HFEngine(load_policy("tiny-qwen2-vl"))
    samples = generate("shapes", 5, split="test", tasks=["count", "color"])
    settings = EvalConfig(samples=2, temperature=0.0, max_new_tokens=4)
    alone = evaluate(engine, samples, settings)

    padded = samples + samples[:1]  # 5 prompts over 2 ranks: 3 each, rank 1's last one a repeat

    class Rank0:
        enabled, world_size, rank, is_main = True, 2, 0, True

        def gather_objects(self, mine):
            scores, failures, examples, _ = _score(engine, padded[3:], settings)
            return [mine, (scores[:2], failures, examples)]

    sharded = evaluate(engine, samples, settings, ctx=Rank0())
    assert sharded.n_prompts == 5
    assert (sharded.accuracy, sharded.greedy, sharded.pass_at_k, sharded.reward) == \
        (alone.accuracy, alone.greedy, alone.pass_at_k, alone.reward)


def test_validation_is_refused_where_it_cannot_run():
    from vlrl.config import ConfigError, DemoConfig, RLConfig, load_config

    assert load_config(RLConfig, None, ["eval.every=2", "rollout.mode=async"]).eval.every == 2  # (issue 48)
    with pytest.raises(ConfigError, match="eval.every: the demo evaluates at its own points"):
        load_config(DemoConfig, None, ["eval.every=2"])
    assert load_config(RLConfig, None, ["eval.every=2"]).eval.every == 2


@pytest.mark.e2e
def test_validation_over_two_fsdp_ranks(tiny_vlm_dir, tmp_path):
    """`torchrun --nproc_per_node 2 … vlrl rl … eval.every=1` (FSDP2): both ranks evaluate their share of the 3 held-out
    prompts at every step (the generate calls are collective), rank 0 logs the whole."""
    from .dist_helpers import run_checked, torchrun

    out = tmp_path / "run"
    run_checked(torchrun(2, "-m", "vlrl.cli", "rl", "--config", str(CONFIGS / "shapes_grpo.yaml"),
                         f"model.path={tiny_vlm_dir}", "train.steps=2", "train.prompts_per_step=2", "rollout.n=2",
                         "train.log_every=1", "data.n_train=8", "data.n_test=3", "eval.samples=2", "eval.every=1",
                         "report.html=false", f"out={out}"), timeout=600, retry_native_abort=True, cwd=REPO)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r["stage"] == "val/rl"]
    assert [r["step"] for r in validation] == [0, 1, 2] and all(r["eval/prompts"] == 3 for r in validation)
