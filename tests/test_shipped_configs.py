"""Every shipped config runs through the command a user types, and its own feature shows in the run's output.

For each file in ``configs/``: ``vlrl sft|rl|demo --config configs/X.yaml`` (`cli`: sft and rl through the ``vlrl``
app in the test's process, the demo as ``python -m vlrl.cli``) with tiny overrides (2
steps, 2 prompts × 4 responses, 2 held-out prompts × 1 sample; a staged config gets the same overrides in each
stage, through a shrunk copy of the file), then the feature the config is for is asserted by its signature in
``metrics.jsonl`` or the run directory — multi-turn episodes take more than one turn, the zoom tool is called, the
judge's feedback is appended, Syn-GRPO submits descriptions, step credit logs its shaping metrics and analysis
file, PPO trains a critic, ReMax scores a greedy baseline, DAPO filters groups, the curriculum switches stages,
staged SFT trains three stages with their own trainable sets, asynchronous runs log staleness. A config whose
feature is silently off fails; a config file without an entry in `CASES` fails too. The real-model recipes of
``configs/recipes/`` run the same way with their family's tiny preset and a fixture dataset in their layout
(`RECIPE_CASES`, at the end). The multi-turn preset also
runs with ``rollout.mode=async`` in-process and against one ``vlrl serve`` server.

Models. The RL presets that need a model which sometimes answers right (DAPO's informative groups, the feedback
environment's early stops, a critic with non-zero returns) start from the ``shapes_sft`` case's own checkpoint
(the README's order: SFT, then RL). ``tool_zoom`` and Syn-GRPO start from a checkpoint SFT'd (through ``vlrl sft
--data``) on prompts of those two presets answered with a zoom call and with the Syn-GRPO template: the features
need a model that calls the tool and writes a description; the tool, the environment and the synthesis are real.
Everything else uses the presets' random initialisation (saved once, loaded from disk).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import forked_runs  # tests/ is on sys.path
import vlrl
from cli_runner import in_process  # tests/ is on sys.path (the test packages' root)
from vlrl.numerics import portable_obstacle

CONFIGS = Path(vlrl.__file__).parent / "configs"  # = the repository's configs/ (a symlink to it)
REPO = Path(__file__).resolve().parents[1]
RL_TINY = ("train.steps=2", "train.prompts_per_step=2", "rollout.n=4", "data.n_train=8", "data.n_test=2",
           "eval.samples=1", "train.log_every=1", "report.html=false")
SFT_TINY = ("train.steps=2", "train.batch_size=4", "train.micro_batch_size=4", "data.n_train=8", "data.n_test=2",
            "eval.samples=1", "train.log_every=1", "report.html=false")
SHORT = ("rollout.max_new_tokens=24", "eval.max_new_tokens=24")  # the embodied presets' 128 tokens, shortened
ZOOM_CALL = "zoom(0, 0, 56, 56)"
SYN_RESPONSE = "<diversity>0.5</diversity><description>a red brick wall</description><answer>[10, 10, 60, 60]</answer>"


# ----------------------------------------------------------------------------------------------- runs
@dataclasses.dataclass
class Run:
    """A finished run: its directory, its metrics.jsonl records, summary.json and resolved config.yaml."""

    path: Path
    records: list[dict]
    summary: dict
    config: dict

    @classmethod
    def read(cls, path: Path) -> Run:
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((path / "summary.json").read_text())
        return cls(path, records, summary, yaml.safe_load((path / "config.yaml").read_text()))

    def stage(self, name: str) -> list[dict]:
        return [r for r in self.records if r["stage"] == name]

    def stages(self) -> list[str]:
        return list(dict.fromkeys(r["stage"] for r in self.records))


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> None:
    """``vlrl ARGS``, which must succeed: ``vlrl sft`` and ``vlrl rl`` through the ``vlrl`` app in this process
    (`in_process`), anything else — the demo (its ``numerics: auto`` is chosen before a process's first tensor
    operation), a run given an environment of its own — as ``python -m vlrl.cli ARGS``, the entry point of the
    ``vlrl`` command, in a process of its own."""
    if args[0] in ("sft", "rl") and env is None:
        in_process(*args)
        return
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", *args], timeout=timeout, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    assert done.returncode == 0, f"vlrl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"


def shrunk(name: str, tmp: Path) -> Path:
    """A staged config with the tiny overrides applied inside every stage (dotted overrides do not reach into
    the ``stages`` list): same stages, same sections, tiny sizes."""
    raw = yaml.safe_load((CONFIGS / name).read_text())
    raw["data"] = {**raw.get("data", {}), "n_train": 8, "n_test": 2}
    raw["eval"] = {**raw.get("eval", {}), "samples": 1, "max_new_tokens": 16}
    raw["report"] = {"html": False}
    for stage in raw["stages"]:
        if "data" in stage:
            stage["data"] = {**stage["data"], "n_train": 8}
        if "rollout" in stage:  # an RL stage
            stage["rollout"] = {**stage["rollout"], "n": 4, "max_new_tokens": min(16, stage["rollout"]["max_new_tokens"])}
            stage["train"] = {**stage["train"], "steps": 2, "prompts_per_step": 2, "log_every": 1}
        else:
            stage["train"] = {**stage["train"], "steps": 2, "batch_size": 4, "micro_batch_size": 4, "log_every": 1}
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_vlm_dir):
    """The presets' random initialisation saved once (tiny-qwen2-vl, and tiny-qwen2 for the text-only preset
    and the judge), so that each run loads it from disk instead of building it (with its tokenizer)."""
    from vlrl.models import load_policy

    text = tmp_path_factory.mktemp("tiny-qwen2")
    load_policy("tiny-qwen2").save(text)
    return {"vlm": tiny_vlm_dir, "lm": text}


@pytest.fixture(scope="module")
def shapes_sft(tmp_path_factory, models) -> Run:
    """``vlrl sft --config configs/shapes_sft.yaml`` long enough to learn the answer format (~20–30 % right):
    the ``shapes_sft`` case, and the warm start of the shapes RL presets."""
    out = tmp_path_factory.mktemp("runs") / "shapes_sft"
    cli("sft", "--config", str(CONFIGS / "shapes_sft.yaml"), f"model.path={models['vlm']}", "train.steps=100",
        "train.batch_size=16", "train.micro_batch_size=16", "optim.lr=2e-3", "train.log_every=50", "data.n_train=400",
        "data.n_test=8", "eval.samples=2", "report.html=false", f"out={out}")
    return Run.read(out)


@pytest.fixture(scope="module")
def tools_sft(tmp_path_factory, models) -> Path:
    """A checkpoint that calls ``zoom`` on the tool_zoom preset's prompts (its instructions appended, as the
    environment does at reset) and writes the Syn-GRPO template on the Syn-GRPO preset's (locate prompts in the
    short template): ``vlrl sft --data`` on 64 + 64 such samples."""
    from vlrl.data import generate, write_samples
    from vlrl.rollout.envs.tool_zoom import INSTRUCTIONS
    from vlrl.synth.workflow import apply_syn_template

    root = tmp_path_factory.mktemp("tools_sft")
    instructions = {"role": "user", "content": [{"type": "text", "text": INSTRUCTIONS}]}
    zoom = [dataclasses.replace(s, id=f"zoom-{s.id}", messages=[*s.messages, instructions], response=ZOOM_CALL)
            for s in generate("shapes", 64, split="train", seed=5, tasks=["count", "color"])]
    syn = [dataclasses.replace(apply_syn_template(s, template="short"), id=f"syn-{s.id}", response=SYN_RESPONSE)
           for s in generate("shapes", 64, split="train", seed=6, tasks=["locate"])]
    data = write_samples(zoom + syn, root / "data" / "train.jsonl")
    cli("sft", "--config", str(CONFIGS / "shapes_sft.yaml"), "--data", str(data), f"model.path={models['vlm']}",
        "train.steps=60", "train.batch_size=16", "train.micro_batch_size=16", "optim.lr=3e-3", "train.log_every=20",
        "data.n_test=2", "eval.samples=1", "report.html=false", f"out={root / 'run'}")
    return root / "run" / "checkpoints" / "final"


# ----------------------------------------------------------------------------------------------- signatures
def rl_trained(run: Run, stage: str = "rl") -> list[dict]:
    """The RL stage logged both steps and saved; a step with a non-zero advantage moved the weights (from a random
    start every reward may be 0: then nothing can move)."""
    records = run.stage(stage)
    assert [r["step"] for r in records] == [1, 2], run.stages()
    for r in records:
        assert r["policy/zero_adv_groups_frac"] == 1.0 or r["policy/grad_norm"] > 0
    assert (run.path / "checkpoints" / "final" / "model.safetensors").is_file()
    return records


def learns(records: list[dict]) -> None:
    """From the SFT warm start some group's responses disagree: a gradient flowed."""
    assert any(r["policy/zero_adv_groups_frac"] < 1 and r["policy/grad_norm"] > 0 for r in records)


def plain_rl(run: Run, advantage: str, *, warm: bool = True) -> list[dict]:
    records = rl_trained(run)
    if warm:
        learns(records)
    assert {"eval/initial", "eval/final"} <= set(run.stages())
    assert run.config["algo"]["advantage"] == advantage
    assert not any(k.startswith(("agent/", "staleness/", "critic/", "sampling/")) for r in records for k in r)
    return records


def multi_turn(run: Run) -> list[dict]:
    """Episodes took more than one turn at some step, with observations appended after the model's turns."""
    records = rl_trained(run)
    assert any(r["agent/turns_mean"] > 1 for r in records), [r.get("agent/turns_mean") for r in records]
    assert all(r["agent/observation_tokens_mean"] > 0 for r in records)
    return records


def shapes_feedback(run: Run) -> None:
    records = multi_turn(run)
    assert any(r["agent/images_per_trajectory"] > 1 for r in records)  # zoom: true shows a crop after a wrong answer
    assert any(r.get("agent/stop/done", 0) > 0 for r in records)  # a right answer ended an episode early


def tool_zoom(run: Run) -> None:
    records = multi_turn(run)
    assert any(r.get("agent/env/zoom_call", 0) > 0 for r in records)  # the tool was called and answered with a crop
    assert any(r["agent/images_per_trajectory"] > 1 for r in records)


def judge(run: Run) -> None:
    records = multi_turn(run)
    assert all("agent/step_reward_mean" in r for r in records)  # the judge's verdict on every turn
    assert run.config["rollout"]["agent"]["env"] == "judge"


def step_credit(run: Run, *, gate: bool = False) -> None:
    records = rl_trained(run)
    for r in records:
        assert "shaping/step_credit/parse_fail_frac" in r and "shaping/step_credit/steps_mean" in r
        assert ("shaping/step_credit/gate_mean" in r) == gate  # the residual-contrast gate ran
    lines = (run.path / "step_credit" / "step_credit.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2] and json.loads(lines[0])["responses"] == 8


def curriculum(run: Run) -> None:
    assert run.stages() == ["eval/initial", "answer_only", "eval/answer_only", "chain_of_thought",
                            "eval/chain_of_thought"]
    for stage in ("answer_only", "chain_of_thought"):
        rl_trained(run, stage)
        assert (run.path / "checkpoints" / stage / "model.safetensors").is_file()
    assert (run.path / "checkpoints" / "final").resolve().name == "chain_of_thought"


def three_stage_sft(run: Run) -> None:
    trainable = {}
    for stage in ("align", "midtrain", "instruct"):
        records = run.stage(stage)
        assert [r["step"] for r in records] == [1, 2]
        trainable[stage] = records[-1]["sft/trainable_params"]
        assert (run.path / "checkpoints" / stage / "model.safetensors").is_file()
    # align trains the projector only; midtrain and instruct train everything (with per-module learning rates)
    assert 0 < trainable["align"] < trainable["midtrain"] == trainable["instruct"]
    assert run.stages()[:3] == ["align", "midtrain", "instruct"]


def sft(run: Run, task: str) -> None:
    records = run.stage("sft")
    assert records and records[-1]["sft/loss"] > 0 and records[-1]["sft/trainable_params"] > 0
    assert task in run.summary["sft"]["accuracy"]


def demo(run: Run) -> None:
    assert {"eval/base", "sft", "eval/sft", "rl", "eval/rl", "sft_control", "eval/sft_control"} <= set(run.stages())
    rl = run.stage("rl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all("policy/skipped_rows_frac" in r for r in rl)  # train.skip_zero_advantage
    assert {"base", "sft", "rl", "sft_control"} <= set(run.summary)
    for stage in ("base", "sft", "rl", "sft_control"):  # issue 52: scored strictly beside the verifier's accuracy
        assert {"strict", "strict_greedy", "well_formed", "well_formed_greedy"} <= set(run.summary[stage])
    assert all("response/well_formed_frac" in r for r in rl) and run.config["rl"]["algo"]["strict_reward"] is True
    environment = run.summary["environment"]  # numerics: auto — portable on an Intel CPU with AVX2, native elsewhere
    assert environment["numerics_requested"] == "auto"
    if portable_obstacle() is None:
        assert environment["numerics"] == "portable" and environment["cpu_kernels"] == "AVX2"
    else:
        assert environment["numerics"] == "native" and environment["numerics_reason"] == portable_obstacle()


def ppo(run: Run) -> None:
    records = rl_trained(run)
    learns(records)
    # the critic trains wherever the returns vary (its head starts at 0: with every reward 0 its loss is exactly 0)
    assert all(r["critic/value_loss"] >= 0 and r["critic/grad_norm"] >= 0 for r in records)
    assert any(r["critic/value_loss"] > 0 for r in records)
    assert all(r["critic/value_loss"] > 0 and r["critic/grad_norm"] > 0 for r in records if r["reward/std"] > 0)
    assert all("policy/kl_ref" in r for r in records)  # the KL penalty in the reward


def dapo(run: Run) -> None:
    records = rl_trained(run)
    learns(records)
    for r in records:
        assert r["sampling/prompts_used"] == 2 and r["policy/zero_adv_groups_frac"] == 0.0  # only informative groups
        assert r["sampling/rounds"] >= 1 and "sampling/groups_dropped" in r
        assert "shaping/overlong_penalty/penalised_frac" in r  # the soft overlong punishment


def remax(run: Run) -> None:
    records = rl_trained(run)
    learns(records)
    assert all("reward/greedy_baseline" in r for r in records)  # one greedy response per prompt, scored


def syn_grpo(run: Run) -> None:
    records = rl_trained(run)
    assert any(r["synth/submitted"] > 0 for r in records)  # descriptions went to the synthesis server
    assert all("shaping/syn_diversity/reward_mean" in r for r in records)  # the diversity reward


def video(run: Run) -> None:
    """Clips fed as their sampled frames: the run states how many videos and frames per video it read."""
    plain_rl(run, "grpo", warm=False)
    data = {k: v for r in run.stage("data") for k, v in r.items()}
    assert data["data/train_videos"] == 8 and data["data/train_frames_per_video"] == 4  # n_train=8, 4-frame clips


def keeps_form(run: Run, name: str, *, warm: bool) -> None:
    """Issue 52: every RL config scores strictly (a truncated or ill-formed answer earns no accuracy reward), logs the
    well-formed fraction at every step, and — from an SFT warm start — its held-out answers stay well-formed: the
    final evaluation's ``well_formed/mean`` is at most 25 points under the initial one (8 prompts × 2 samples)."""
    def settings(node):
        if isinstance(node, dict):
            yield from ([node["strict_reward"]] if "strict_reward" in node else [])
            for value in node.values():
                yield from settings(value)
        elif isinstance(node, list):
            for value in node:
                yield from settings(value)

    assert list(settings(run.config)) and all(settings(run.config)), f"{name}: algo.strict_reward is off"
    steps = [r for r in run.records if "policy/loss" in r]
    assert steps and all("response/well_formed_frac" in r for r in steps), name
    if warm:
        initial, final = (run.stage(f"eval/{stage}")[-1]["well_formed/mean"] for stage in ("initial", "final"))
        assert final >= initial - 0.25, f"{name}: held-out answers well-formed {initial:.2f} before RL, {final:.2f} after"


def asynchronous(run: Run) -> list[dict]:
    records = rl_trained(run)
    assert all("staleness/mean" in r and "staleness/max" in r and "perf/wait_seconds" in r for r in records)
    return records


@dataclasses.dataclass(frozen=True)
class Case:
    recipe: str  # sft | rl | demo
    check: Callable[[Run], None]
    overrides: tuple[str, ...] = ()
    start: str = "random"  # random | shapes_sft | tools_sft: where model.path points
    staged: bool = False  # run a shrunk copy (tiny sizes inside every stage)


CASES: dict[str, Case] = {
    "arith_grpo.yaml": Case("rl", lambda run: (plain_rl(run, "grpo", warm=False), _text_only(run)), start="lm"),
    "curriculum_grpo.yaml": Case("rl", curriculum, staged=True),
    "demo.yaml": Case("demo", demo),
    "embodied_forward_proxy.yaml": Case("rl", step_credit, SHORT),
    "embodied_grpo.yaml": Case("rl", lambda run: (plain_rl(run, "grpo", warm=False), _no_step_credit(run)), SHORT),
    "embodied_residual_gate.yaml": Case("rl", lambda run: step_credit(run, gate=True), SHORT),
    "embodied_rule_exact.yaml": Case("rl", step_credit, SHORT),
    "embodied_rule_lcs.yaml": Case("rl", step_credit, SHORT),
    "embodied_rule_prefix.yaml": Case("rl", step_credit, SHORT),
    "embodied_sft.yaml": Case("sft", lambda run: sft(run, "embodied/pick_place"), ("eval.max_new_tokens=24",)),
    "embodied_stepopsd.yaml": Case("rl", step_credit, SHORT),
    "judge_grpo.yaml": Case("rl", judge, ("rollout.agent.env_kwargs.judge={lm}",)),
    "shapes_dapo.yaml": Case("rl", dapo, start="shapes_sft"),
    "shapes_dr_grpo.yaml": Case("rl", lambda run: plain_rl(run, "dr_grpo"), start="shapes_sft"),
    "shapes_lora_grpo.yaml": Case("rl", lambda run: lora(run), start="shapes_sft"),
    "shapes_feedback_grpo.yaml": Case("rl", shapes_feedback, start="shapes_sft"),
    "shapes_grpo.yaml": Case("rl", lambda run: plain_rl(run, "grpo"), start="shapes_sft"),
    "shapes_opd.yaml": Case("rl", lambda run: opd(run), ("algo.distill.teacher={sft}",)),
    "shapes_ppo.yaml": Case("rl", ppo, start="shapes_sft"),
    "shapes_reinforce_pp.yaml": Case("rl", lambda run: _kl_in_reward(rl_trained(run)), start="shapes_sft"),
    "shapes_remax.yaml": Case("rl", remax, start="shapes_sft"),
    "shapes_rloo.yaml": Case("rl", lambda run: plain_rl(run, "rloo"), start="shapes_sft"),
    "shapes_sft.yaml": Case("sft", lambda run: sft(run, "shapes/count")),  # the shapes_sft fixture's run
    "shapes_video_grpo.yaml": Case("rl", video),
    "shapes_syn_grpo.yaml": Case("rl", syn_grpo, ("synth.poll_interval=0.05",), start="tools_sft"),
    "three_stage_sft.yaml": Case("sft", three_stage_sft, staged=True),
    "tool_zoom_grpo.yaml": Case("rl", tool_zoom, start="tools_sft"),
}


# issue 25: the losses of the Syn-GRPO seed's comparison and the sequence-level losses. Each preset trains from the SFT
# warm start and logs its loss's own metric, non-zero where the mechanism acted (the presets run 2 minibatches, so
# the second one is off-policy where a clip or penalty can bind).
def loss_active(loss: str, metric: str, *also: str) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        records = plain_rl(run, "grpo")
        assert run.config["algo"]["policy_loss"] == loss
        for r in records:
            assert all(f"policy/{name}" in r for name in (metric, *also)), sorted(r)
            assert r["policy/loss"] == r["policy/loss"]  # not NaN
        assert any(r[f"policy/{metric}"] > 0 for r in records), [r[f"policy/{metric}"] for r in records]
    return check


def seq_clip_active(loss: str) -> Callable[[Run], None]:
    """GSPO's clip at 1 ± 4e-4 on the sequence ratio binds once the weights moved (ppo_clip's 0.2 would not)."""
    def check(run: Run) -> None:
        records = plain_rl(run, "grpo")
        assert run.config["algo"]["policy_loss"] == loss and run.config["algo"]["clip_high"] < 1e-3
        assert all("policy/ratio" in r for r in records)
        assert any(r["policy/clip_low"] + r["policy/clip_high"] > 0 for r in records), records
    return check


CASES.update({
    "shapes_gspo.yaml": Case("rl", seq_clip_active("gspo"), start="shapes_sft"),
    # CISPO truncates the weight at 1 + ε_high: a tight ε_high shows the truncation at 2 tiny steps
    "shapes_cispo.yaml": Case("rl", loss_active("cispo", "clip_high", "ratio"), ("algo.clip_high=0.001",),
                              start="shapes_sft"),
    "shapes_clip_cov.yaml": Case("rl", loss_active("clip_cov", "clip_cov"), start="shapes_sft"),
    "shapes_kl_cov.yaml": Case("rl", loss_active("kl_cov", "kl_cov", "ratio"), start="shapes_sft"),
    "shapes_entropy_adv.yaml": Case("rl", loss_active("entropy_advantage", "entropy_adv", "entropy_adv_capped"),
                                    start="shapes_sft"),
})


def lora(run: Run) -> None:
    """LoRA: a few % of the weights train, the KL to the adapter-free base is logged, and the export holds the
    merged model plus adapter/ (adapter_config.json with the configured rank)."""
    records = rl_trained(run)
    assert all("policy/kl_ref" in r for r in records)
    assert 0 < records[-1]["policy/trainable_params"] < 0.2 * 1.06e6
    final = run.path / "checkpoints" / "final"
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == run.config["model"]["lora"]["r"] and (final / "model.safetensors").is_file()


def _text_only(run: Run) -> None:
    """A causal LM (no vision tower) trained on the arith word problems."""
    trained = json.loads((run.path / "checkpoints" / "final" / "config.json").read_text())
    assert "vision_config" not in trained
    assert {"reward/arith/add", "reward/arith/sub"} & set(run.stage("rl")[-1])


def _no_step_credit(run: Run) -> None:
    assert not (run.path / "step_credit").exists()
    assert any(k.startswith("reward/embodied/") for k in run.stage("rl")[-1])


def opd(run: Run) -> None:
    """On-policy distillation from the shapes_sft checkpoint (the teacher, in-process or on a `vlrl serve` server)
    into the untrained preset (the student): the sampled reverse KL, the teacher's log-probs and (in-process) the
    argmax agreement are logged every step, finite, and the KL is not 0 (the top-k estimator through the CLI:
    tests/train/test_distill.py)."""
    records = rl_trained(run)
    distill = run.config["algo"]["distill"]
    assert (distill["teacher"] or "").endswith("final") or distill["teacher_urls"]
    for r in records:
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/teacher_logprob"] < 0, r
        if distill["teacher"]:  # a teacher on a server gives no argmax (its scores are the sampled tokens')
            assert 0 <= r["distill/agreement"] <= 1, r
    assert any(r["distill/reverse_kl"] != 0 for r in records)


def _kl_in_reward(records: list[dict]) -> None:
    assert all("policy/kl_ref" in r for r in records)


# ----------------------------------------------------------------------------------------------- the tests
def test_every_shipped_config_has_a_case():
    """A new config file needs an entry in CASES saying how its feature shows (and a case needs its file)."""
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(CASES)


def _start(case: Case, models, request) -> str:
    if case.start == "random":
        return str(models["vlm"])
    if case.start == "lm":
        return str(models["lm"])
    if case.start == "shapes_sft":
        return str(request.getfixturevalue("shapes_sft").path / "checkpoints" / "final")
    return str(request.getfixturevalue("tools_sft"))


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_config_runs_with_its_feature_on(name, models, request, tmp_path):
    if name not in CASES:
        pytest.fail(f"configs/{name} has no entry in tests/test_shipped_configs.py CASES: say how its feature shows")
    case = CASES[name]
    if name == "shapes_sft.yaml":  # the warm start of the shapes presets is this config's own run
        case.check(request.getfixturevalue("shapes_sft"))
        return
    out = tmp_path / "run"
    config = shrunk(name, tmp_path) if case.staged else CONFIGS / name
    model = _start(case, models, request)
    warm = case.start in ("shapes_sft", "tools_sft")  # an SFT checkpoint that writes the answer form
    if case.recipe == "demo":
        args = ["demo", "--config", str(config), "--out", str(out), f"model.path={model}", "data.n_train=16",
                "data.n_test=2", "sft.train.steps=2", "sft.train.batch_size=4", "sft.train.micro_batch_size=4",
                "rl.train.steps=2", "rl.train.prompts_per_step=2", "rl.train.log_every=1", "eval.samples=1",
                "report.html=false"]
    else:
        tiny = () if case.staged else (RL_TINY if case.recipe == "rl" else SFT_TINY)
        overrides = [o.format(lm=models["lm"], sft="{sft}") for o in case.overrides]
        if any("{sft}" in o for o in overrides):  # a second model: the shapes_sft checkpoint (OPD's teacher)
            sft = request.getfixturevalue("shapes_sft").path / "checkpoints" / "final"
            overrides = [o.replace("{sft}", str(sft)) for o in overrides]
        if case.recipe == "rl" and warm:  # enough held-out answers to see their form fall (keeps_form)
            overrides += ["data.n_test=8", "eval.samples=2"]
        args = [case.recipe, "--config", str(config), f"model.path={model}", *tiny, *overrides, f"out={out}"]
    cli(*args)
    run = Run.read(out)
    case.check(run)
    if case.recipe == "rl":
        keeps_form(run, name, warm=warm and not case.staged)
    if case.recipe == "rl" and run.config["rollout"]["mode"] == "async":
        asynchronous(run)


@pytest.mark.e2e
def test_the_multi_turn_preset_asynchronous_in_process(request, tmp_path):
    """``rollout.mode=async`` without servers: the episodes run behind the threaded engine's ``agenerate``."""
    model = request.getfixturevalue("shapes_sft").path / "checkpoints" / "final"
    cli("rl", "--config", str(CONFIGS / "shapes_feedback_grpo.yaml"), f"model.path={model}", *RL_TINY,
        "rollout.mode=async", "staleness.eta=1", f"out={tmp_path}")
    run = Run.read(tmp_path)
    shapes_feedback(run)
    asynchronous(run)


@pytest.mark.e2e
def test_the_multi_turn_preset_asynchronous_against_a_vlrl_serve_server(request, tmp_path):
    """``rollout.mode=async`` with one ``vlrl serve`` server: every turn of every episode (its context: prompt,
    earlier turns, observations and their zoomed crops) is generated by the server, which loads the trainer's
    weights after each step."""
    model = request.getfixturevalue("shapes_sft").path / "checkpoints" / "final"
    key = {"VLRL_API_KEY": "shipped-configs-test"}
    port = _free_port()
    server, log = _serve(["--model", str(model), "--port", str(port)], {**os.environ, "OMP_NUM_THREADS": "1", **key})
    try:
        _wait_for_port(port, server, log)
        cli("rl", "--config", str(CONFIGS / "shapes_feedback_grpo.yaml"), f"model.path={model}", *RL_TINY,
            "rollout.mode=async", "staleness.eta=1", f"rollout.servers.urls=[http://127.0.0.1:{port}]",
            f"out={tmp_path}", env=key)
    finally:
        server.terminate()
        server.wait(timeout=30)
    run = Run.read(tmp_path)
    shapes_feedback(run)
    asynchronous(run)
    assert (tmp_path / "rollout_weights").is_dir()  # the weights the server loaded


@pytest.mark.e2e
def test_shapes_opd_with_its_teacher_on_a_vlrl_serve_server(request, models, tmp_path):
    """``vlrl rl --config configs/shapes_opd.yaml algo.distill.teacher=null algo.distill.teacher_urls=[URL]``: the
    teacher (the shapes_sft checkpoint) served by ``vlrl serve`` on loopback scores every trajectory (prefill-only
    requests: the server counts their rows; nothing else talks to it), and the run logs OPD's metrics as with the
    teacher in-process."""
    import httpx

    teacher = request.getfixturevalue("shapes_sft").path / "checkpoints" / "final"
    port = _free_port()
    server, log = _serve(["--model", str(teacher), "--port", str(port), "--no-auth", "--threads", "1"],
                         {**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for_port(port, server, log)
        cli("rl", "--config", str(CONFIGS / "shapes_opd.yaml"), f"model.path={models['vlm']}", *RL_TINY,
            "algo.distill.teacher=null", f"algo.distill.teacher_urls=[http://127.0.0.1:{port}]", f"out={tmp_path}")
        served = httpx.get(f"http://127.0.0.1:{port}/get_model_info", timeout=30).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    run = Run.read(tmp_path)
    opd(run)
    assert run.config["algo"]["distill"]["teacher"] is None
    # 2 steps × 2 prompts × 4 responses, each with tokens scored once (a response may be empty); nothing sampled
    assert served["rows"] >= 8 and served["decode_steps"] == 0, served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], env: dict) -> tuple:
    """``vlrl serve ARGS`` (a process forked from an already-imported one: tests/forked_runs.py); (process, its log)."""
    log = Path(tempfile.mkdtemp(prefix="vlrl-serve-")) / "serve.log"
    return forked_runs.popen([sys.executable, "-m", "vlrl.cli", "serve", *args], log=log, env=env), log


def _wait_for_port(port: int, process, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vlrl serve exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"vlrl serve did not listen on port {port} within {timeout:.0f}s")


# ----------------------------------------------------------------------------------------------- recipes (issue 34)
# configs/recipes/: the real-model runs people launch. Each runs here through `vlrl rl` with its family's tiny preset
# (model.path), on CPU, 2 steps, on the fixture dataset in the recipe's layout (tests/data/foreign.py: EasyR1's
# geometry3k, verl's geo3k parquet, TRL's multimodal-open-r1; vlrl's own jsonl for the LLaVA-OV-1.5 stages), and its
# feature is asserted: the layout read, validation during training, LoRA, the rollout server, the curriculum's stages.
RECIPES = CONFIGS / "recipes"
RECIPE_TINY = ("train.steps=2", "train.prompts_per_step=2", "rollout.n=4", "train.minibatches=1", "train.micro_batch_size=8",
               "rollout.max_new_tokens=12", "rollout.engine.max_batch_size=64", "eval.samples=1", "eval.max_new_tokens=12",
               "train.log_every=1", "report.html=false", "checkpoint.every=0", "model.device=cpu", "model.dtype=float32",
               "dist.mixed_precision=none", "model.min_pixels=null", "model.max_pixels=null", "launch.rollout_servers=0",
               "optim.warmup_steps=0")


@dataclasses.dataclass(frozen=True)
class Recipe:
    preset: str  # the family's tiny preset
    layout: str  # the fixture data in the recipe's layout: easyr1 | verl | trl | vlrl
    check: Callable[[Run, str], None]  # (the run, its log)
    server: bool = False  # run against one `vlrl serve` of the preset
    after: str | None = None  # the recipe whose run this one starts from (model.path)


def _validated(run: Run, every: int = 1) -> None:
    """eval.every: val/rl at 0 (initial), at the loop's steps, and at 2 (final)."""
    assert [r["step"] for r in run.stage("val/rl")] == [0, 1, 2] and run.config["eval"]["every"] == every


def _geo3k_3b(run: Run, log: str) -> None:
    rl_trained(run)
    assert "easyr1 layout (data.format" in log and "policy/kl_ref" in run.stage("rl")[-1]  # the KL loss term
    _validated(run)
    assert run.config["dist"]["strategy"] == "fsdp" and run.config["data"]["reward"] == {"math": 0.9, "cot_format": 0.1}
    assert "MUST BE put in \\boxed{}" in json.loads((run.path / "samples.jsonl").read_text().splitlines()[0])["prompt"]


def _lora_7b(run: Run, log: str) -> None:
    records = rl_trained(run)
    assert "trl layout (data.format" in log and 0 < records[-1]["policy/trainable_params"] < 1.08e6  # not all 1.08M
    assert json.loads((run.path / "checkpoints" / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 64
    _validated(run)


def _qwen3_servers(run: Run, log: str) -> None:
    rl_trained(run)
    assert "verl layout (data.format" in log and (run.path / "rollout_weights").is_dir()  # the server loaded them
    assert run.config["model"]["chat_template_kwargs"] == {"enable_thinking": False}
    _validated(run)


def _llava_stage(cot: bool) -> Callable[[Run, str], None]:
    """Asynchronous (staleness metrics), the seed's reward scale, and the stage's own prompt template in every prompt."""
    def check(run: Run, log: str) -> None:
        asynchronous(run)
        assert run.config["algo"]["reward_shaping"] == [{"name": "reward_scale", "options": {"scale": 10.0, "bias": -0.5}}]
        prompts = [json.loads(line)["prompt"] for line in (run.path / "samples.jsonl").read_text().splitlines()]
        assert prompts and all(p.endswith("Put ONLY your final answer within <answer></answer>.") for p in prompts)
        assert all(("Think and solve the following question step by step." in p) == cot for p in prompts)
    return check


RECIPE_CASES: dict[str, Recipe] = {
    "qwen2_5_vl_3b_geo3k_grpo.yaml": Recipe("tiny-qwen2.5-vl", "easyr1", _geo3k_3b),
    "qwen2_5_vl_7b_lora_grpo.yaml": Recipe("tiny-qwen2.5-vl", "trl", _lora_7b),
    "qwen3_vl_8b_servers_grpo.yaml": Recipe("tiny-qwen3-vl", "verl", _qwen3_servers, server=True),
    # LLaVA-OV-1.5 (RICE-ViT + Qwen3, its own code) has no class in transformers 5.24: the native-resolution,
    # 2×2-merge family it follows stands in
    "llava_ov_1_5_rl_answer_only.yaml": Recipe("tiny-qwen2.5-vl", "vlrl", _llava_stage(cot=False)),
    "llava_ov_1_5_rl_cot.yaml": Recipe("tiny-qwen2.5-vl", "vlrl", _llava_stage(cot=True),
                                       after="llava_ov_1_5_rl_answer_only.yaml"),
}


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(train, test) of each layout, as the recipes' data.train / data.test."""
    sys.path.insert(0, str(REPO / "tests" / "data"))
    import foreign

    from vlrl.data import generate, write_samples

    root = tmp_path_factory.mktemp("recipe_data")
    paths = foreign.write_all(root)
    bare = generate("shapes", 8, split="train", tasks=["count"], template="none")  # questions without instructions
    write_samples(bare, root / "vlrl" / "train.jsonl")
    return {"easyr1": (f"{paths['easyr1']}@train", f"{paths['easyr1']}@test"),
            "verl": (str(paths["verl"] / "train.parquet"), str(paths["verl"] / "test.parquet")),
            "trl": (str(paths["trl"] / "train.arrow"), ""),  # the recipe holds its test prompts out of train
            "vlrl": (str(root / "vlrl" / "train.jsonl"), "")}


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, recipe_data):
    """name → (Run, log), each recipe run once (a stage runs its `after` first)."""
    from vlrl.models import load_policy

    runs: dict[str, tuple[Run, str]] = {}
    presets: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("recipe_runs")

    def run(name: str) -> tuple[Run, str]:
        if name in runs:
            return runs[name]
        case = RECIPE_CASES[name]
        if case.preset not in presets:
            presets[case.preset] = root / case.preset
            load_policy(case.preset).save(presets[case.preset])
        model = run(case.after)[0].path / "checkpoints" / "final" if case.after else presets[case.preset]
        train, test = recipe_data[case.layout]
        raw = yaml.safe_load((RECIPES / name).read_text())
        out = root / name.removesuffix(".yaml")
        args = ["rl", "--config", str(RECIPES / name), f"model.path={model}", f"data.train={train}", *RECIPE_TINY,
                *([f"data.test={test}"] if test else []), *(["eval.every=1"] if raw.get("eval", {}).get("every") else []),
                f"out={out}"]
        if case.server:
            runs[name] = (None, _with_server(str(presets[case.preset]), args))  # type: ignore[assignment]
        else:
            runs[name] = (None, in_process(*args))  # type: ignore[assignment]
        runs[name] = (Run.read(out), runs[name][1])
        return runs[name]

    return run


def _cli_log(*args: str, env: dict | None = None) -> str:
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", *args], timeout=900, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                "HF_HUB_OFFLINE": "1", **(env or {})})
    assert done.returncode == 0, f"vlrl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return " ".join((done.stdout + done.stderr).split())  # rich wraps long lines


def _with_server(model: str, args: list[str]) -> str:
    """The run against one `vlrl serve` of ``model`` (rollout.servers.urls; the launch's servers stood in for)."""
    key = {"VLRL_API_KEY": "recipes-test"}
    port = _free_port()
    server, log = _serve(["--model", model, "--port", str(port), "--attn-implementation", "sdpa"],
                         {**os.environ, "OMP_NUM_THREADS": "1", **key})
    try:
        _wait_for_port(port, server, log)
        return _cli_log(*args, f"rollout.servers.urls=[http://127.0.0.1:{port}]", env=key)
    finally:
        server.terminate()
        server.wait(timeout=30)


# Recipes on vLLM servers run, CPU-sized, against the one vLLM server the live tests share (its start-up is minutes):
# recipe → the test that runs it.
VLLM_RECIPES = {"qwen2_5_7b_math_vllm_grpo.yaml": "tests/rollout/test_vllm_live.py::test_shipped_vllm_recipe_cpu_sized"}


def test_every_recipe_has_a_case():
    """A recipe in configs/recipes/ needs an entry in RECIPE_CASES (its family preset, its layout, its signature) — or,
    on vLLM servers, in VLLM_RECIPES (a test that exists) —, and its comment block says the hardware it is sized for and
    its memory per GPU (checked against `vlrl plan` below)."""
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted([*RECIPE_CASES, *VLLM_RECIPES])
    for test in VLLM_RECIPES.values():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (REPO / path).read_text(), test
    for path in RECIPES.glob("*.yaml"):
        head = path.read_text().split("\nmodel:")[0]
        assert "Hardware:" in head and "# expected memory per GPU: " in head and "vlrl plan" in head, path.name


# (recipe, the published config.json it is planned from, GPUs, GPU memory, {placement line: GiB stated in the recipe})
PLANNED = [
    ("qwen2_5_vl_3b_geo3k_grpo.yaml", "qwen2_5_vl_3b.json", 8, 80, {"#1 colocated fsdp×8": 29.70}),
    ("qwen2_5_vl_7b_lora_grpo.yaml", "qwen2_5_vl_7b.json", 1, 48, {"#1 colocated fsdp×1": 22.45}),
    ("qwen3_vl_8b_servers_grpo.yaml", "qwen3_vl_8b.json", 8, 80,
     {"trainer fsdp×4 + 4": 45.46, "rollout fsdp×4 + 4": 58.38, "#1 colocated fsdp×8": 37.91}),
    ("llava_ov_1_5_rl_answer_only.yaml", "qwen3_vl_8b.json", 8, 80, {"trainer fsdp×4 + 4": 46.32, "rollout fsdp×4 + 4": 55.35}),
    ("llava_ov_1_5_rl_cot.yaml", "qwen3_vl_8b.json", 8, 80, {"trainer fsdp×4 + 4": 46.32, "rollout fsdp×4 + 4": 55.35}),
    ("qwen2_5_7b_math_vllm_grpo.yaml", "qwen2_5_7b.json", 1, 80, {"#1 colocated fsdp×1": 31.99}),
]


def _planned_gib(output: str, placement: str) -> float:
    """The GiB per device `vlrl plan` prints for ``placement``: "#1 colocated fsdp×8" (all devices), or "trainer
    fsdp×4 + 4" / "rollout fsdp×4 + 4" (that side of the separate placement with 4 trainer ranks)."""
    import re

    side, _, rest = placement.partition(" ")
    lines = output.splitlines()
    if side in ("trainer", "rollout"):
        start = next(i for i, line in enumerate(lines) if "separate: trainer " + rest.replace(" + 4", " + 4 rollout") in line)
        label = f"memory per device, {side} ("
    else:
        start = next(i for i, line in enumerate(lines) if line.startswith(placement + ":"))
        label = "memory per device, all devices:"
    line = next(line for line in lines[start:start + 40] if label in line)
    return float(re.search(r": ([0-9.]+) GiB of", line).group(1))


@pytest.mark.parametrize("name, fixture, gpus, memory, stated", PLANNED, ids=[p[0] for p in PLANNED])
def test_recipe_memory_is_what_vlrl_plan_says(tmp_path, name, fixture, gpus, memory, stated):
    """Each recipe's "expected memory per GPU" is `vlrl plan`'s, from the model's published config.json (no weights,
    no tokenizer: tests/fixtures/model_configs/) and prompts of one 448×448 image (a text model's: the words alone) —
    the command its comment gives."""
    from PIL import Image
    from skimage import data as images
    from typer.testing import CliRunner

    from vlrl.cli import app

    Image.fromarray(images.astronaut()).resize((448, 448)).save(tmp_path / "a.png")
    question = ("In the figure, AB is a diameter of the circle and angle ACB is inscribed. Find the measure of angle "
                "ABC if angle CAB is 35 degrees. ") * 2
    row = {"task": "geo", "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
           "images": ["a.png"], "answer": "55", "reward": "math"}
    if "_vl_" not in fixture:  # a text model: the same question without the image
        row = {**row, "messages": [{"role": "user", "content": question}], "images": []}
    (tmp_path / "sample.jsonl").write_text("".join(json.dumps({"id": f"p{k}", **row}) + "\n" for k in range(8)))
    head = (RECIPES / name).read_text().split("\nmodel:")[0]
    assert f"tests/fixtures/model_configs/{fixture}" in head
    result = CliRunner().invoke(app, [
        "plan", str(RECIPES / name), "--gpus", str(gpus), "--gpu-mem", str(memory),
        f"model.path={REPO / 'tests' / 'fixtures' / 'model_configs' / fixture}", "model.trust_remote_code=false",
        f"data.train={tmp_path / 'sample.jsonl'}", "data.format=vlrl", "data.prompt_template=null", "data.test=null"])
    assert result.exit_code == 0, result.output
    for placement, gib in stated.items():
        assert _planned_gib(result.output, placement) == gib, placement
        assert f"{gib:.2f} GiB" in head, (name, gib)


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(RECIPE_CASES))
def test_recipe_runs_with_its_family_preset(name, recipe_runs):
    run, log = recipe_runs(name)
    RECIPE_CASES[name].check(run, log)
