import json

import pytest
from typer.testing import CliRunner

import forked_runs  # tests/ is on sys.path
from vlrl.cli import app

runner = CliRunner()


def test_data_gen_writes_readable_samples(tmp_path):
    result = runner.invoke(app, ["data", "gen", "shapes", "--n", "6", "--split", "test", "--out", str(tmp_path),
                                 "--tasks", "count,ocr"])
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "test.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[1])["task"] == "shapes/ocr"
    from vlrl.data import read_samples

    assert len(read_samples(tmp_path / "test.jsonl").samples) == 6


def test_data_gen_embodied_round_trips_its_scene(tmp_path):
    from vlrl.data import read_samples
    from vlrl.rewards import compose

    result = runner.invoke(app, ["data", "gen", "embodied", "--n", "4", "--out", str(tmp_path), "--tasks", "cool"])
    assert result.exit_code == 0, result.output
    for sample in read_samples(tmp_path / "train.jsonl").samples:  # metadata (scene, actions) survives JSON
        assert compose(sample.response, sample.answer, sample.reward, sample.metadata).overall == 1.0


def test_unknown_suite_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["data", "gen", "juggling", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown task suite 'juggling'" in result.output


def test_bad_override_exits_with_the_field_name(tmp_path):
    result = runner.invoke(app, ["rl", f"out={tmp_path}", "algo.clip_hihg=0.3"])
    assert result.exit_code == 2
    assert "config field 'algo.clip_hihg': unknown field" in result.output


def test_sft_on_a_user_file_then_eval(tmp_path):
    """A training file without a test file: 10 % of it is held out (16 samples → round(1.6) = 2), never the
    procedural suite; `vlrl eval` on the run's checkpoint evaluates those same 2 prompts by default."""
    runner.invoke(app, ["data", "gen", "arith", "--n", "16", "--out", str(tmp_path / "data")])
    result = runner.invoke(app, ["sft", "--data", str(tmp_path / "data" / "train.jsonl"), f"out={tmp_path / 'run'}",
                                 "model.path=tiny-qwen2", "data.suite=shapes", "train.steps=2", "train.batch_size=4",
                                 "eval.samples=2"])
    assert result.exit_code == 0, result.output
    assert "held out 2 of 16 samples" in " ".join(result.output.split())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sft"]["n_prompts"] == 2 and all(t.startswith("arith/") for t in summary["sft"]["accuracy"] if t != "mean")
    assert (tmp_path / "run" / "checkpoints" / "final" / "model.safetensors").exists()
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "run" / "checkpoints" / "final"), "--seed", "1",
                                 "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["n_prompts"] == 2 and evaluated["settings"]["samples"] == 2  # the run's eval.samples
    assert set(evaluated["accuracy"]) == set(summary["sft"]["accuracy"])
    for table in ("strict", "strict_greedy", "well_formed", "well_formed_greedy"):  # issue 52: strict beside them
        assert set(evaluated[table]) == set(summary["sft"][table]) == set(summary["sft"]["accuracy"])
    for task in evaluated["accuracy"]:  # right and well-formed: never above either
        assert evaluated["strict"][task] <= min(evaluated["accuracy"][task], evaluated["well_formed"][task])
        assert evaluated["strict_greedy"][task] <= min(evaluated["greedy"][task], evaluated["well_formed_greedy"][task])
    assert "the run's held-out split of" in result.output
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "run" / "checkpoints" / "final"),
                                 "--data", str(tmp_path / "data" / "train.jsonl"), "--samples", "2", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert '"n_prompts": 16' in result.output and '"max_new_tokens": 4' in result.output


def test_check_lists_every_problem_and_exits_1(tmp_path):
    config = tmp_path / "rl.yaml"
    config.write_text("rollout: {n: 4, max_new_tokens: 4000}\ntrain: {prompts_per_step: 4, micro_batch_size: 6}\n"
                      "data: {n_train: 16, n_test: 8}\n")
    result = runner.invoke(app, ["check", str(config), "algo.advantage=nope"])
    assert result.exit_code == 1, result.output
    assert "(as a `vlrl rl` config)" in result.output
    for field in ("rollout.max_new_tokens", "train.micro_batch_size", "algo.advantage"):
        assert f"✗ {field}:" in result.output, field
    assert "preflight: 3 problem(s)" in result.output


def test_check_passes_a_shipped_config_and_reports_bad_keys():
    result = runner.invoke(app, ["check", "configs/shapes_sft.yaml", "data.n_train=16", "data.n_test=8"])
    assert result.exit_code == 0, result.output
    assert "(as a `vlrl sft` config)" in result.output and "preflight: ok" in result.output
    result = runner.invoke(app, ["check", "configs/demo.yaml", "rl.algo.clip_hgh=0.3"])
    assert result.exit_code == 1 and "config field 'rl.algo.clip_hgh': unknown field" in result.output


def test_a_recipe_stops_at_the_preflight(tmp_path):
    result = runner.invoke(app, ["rl", f"out={tmp_path}", "data.n_train=16", "data.n_test=8", "eval.max_new_tokens=4000"])
    assert result.exit_code == 1
    assert "eval.max_new_tokens:" in result.output and "exceeds the model context of 2048 tokens" in result.output
    assert not (tmp_path / "checkpoints").exists()


def test_rl_writes_a_report_and_report_compares_runs(tmp_path):
    import shutil

    run = tmp_path / "text_rl"
    result = runner.invoke(app, ["rl", f"out={run}", "model.path=tiny-qwen2", "data.suite=arith", "data.tasks=[add]",
                                 "data.n_train=16", "data.n_test=4", "train.steps=2", "train.prompts_per_step=2",
                                 "rollout.n=2", "rollout.max_new_tokens=4", "eval.samples=2", "eval.max_new_tokens=4"])
    assert result.exit_code == 0, result.output
    html = (run / "report.html").read_text()
    assert 'id="dynamics"' in html and 'data-stage="eval/final"' in html and 'data-stage="rl step 2"' in html
    shutil.copytree(run, tmp_path / "copy")
    result = runner.invoke(app, ["report", str(run), str(tmp_path / "copy"), "--out", str(tmp_path / "cmp.html")])
    assert result.exit_code == 0, result.output
    assert '[&#34;text_rl&#34;, &#34;copy&#34;]' in (tmp_path / "cmp.html").read_text()  # data-runs of the charts
    result = runner.invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_data_pack_then_sft_from_the_plan(tmp_path):
    runner.invoke(app, ["data", "gen", "arith", "--n", "24", "--out", str(tmp_path / "data")])
    data = tmp_path / "data" / "train.jsonl"
    result = runner.invoke(app, ["data", "pack", "--data", str(data), "--model", "tiny-qwen2", "--capacity", "120",
                                 "--out", str(tmp_path / "plan.npz"), "--workers", "2"])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "plan.json").read_text())["stats"]
    assert stats["packed_samples"] == 24 and stats["bins"] < 24 and "lower bound" in result.output
    result = runner.invoke(app, ["sft", "--data", str(data), f"out={tmp_path / 'run'}", "model.path=tiny-qwen2",
                                 f"data.packing_plan={tmp_path / 'plan.npz'}", "--test", str(data),
                                 "train.steps=2", "train.batch_size=2", "train.micro_batch_size=1", "eval.samples=1",
                                 "eval.max_new_tokens=2", "report.html=false"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["train"]["steps"] == 2


def test_data_pack_reports_bad_input(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "task": "t", "prompt": "<image>hi", "images": ["nope.png"], "reward": "number", "response": "1"}\n')
    result = runner.invoke(app, ["data", "pack", "--data", str(tmp_path / "bad.jsonl"), "--capacity", "64",
                                 "--out", str(tmp_path / "p.npz")])
    assert result.exit_code == 2 and "bad.jsonl:1: field 'images[0]': image file not found" in result.output


def test_sft_stages_option_names_unknown_stages(tmp_path):
    result = runner.invoke(app, ["sft", "--config", "src/vlrl/configs/three_stage_sft.yaml", "--stages", "alignn",
                                 f"out={tmp_path}"])
    assert result.exit_code == 2 and "unknown stage(s) ['alignn']" in result.output and "align, " not in result.output


def test_eval_reads_the_eval_settings_and_data_of_any_runs_config(tmp_path, tiny_vlm_dir):
    """A staged run's config.yaml (whose top-level optim/train would not load as an SFTConfig again) still gives
    `vlrl eval` its data and eval sections; options win over them; a plain model gets the defaults."""
    from vlrl.config import SFTConfig, dump_config, load_config

    runner.invoke(app, ["data", "gen", "shapes", "--n", "3", "--split", "test", "--out", str(tmp_path / "data")])
    run = tmp_path / "staged"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "final").symlink_to(tiny_vlm_dir, target_is_directory=True)
    cfg = load_config(SFTConfig, None, [f"data.test={tmp_path / 'data' / 'test.jsonl'}", "eval.samples=2",
                                        "eval.max_new_tokens=3", "stages=[{name: a}, {name: b}]"])
    (run / "config.yaml").write_text(dump_config(cfg))
    result = runner.invoke(app, ["eval", "--model", str(run / "checkpoints" / "final"), "--temperature", "0.5",
                                 "--top-k", "5", "--out", str(tmp_path / "e.json")])
    assert result.exit_code == 0, result.output
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert evaluated["n_prompts"] == 3 and evaluated["k"] == 2
    assert evaluated["settings"] == {"samples": 2, "temperature": 0.5, "top_k": 5, "max_new_tokens": 3,
                                     "max_batch_size": 256, "seed": 0,  # the run's numerics (native): kept
                                     "numerics": {"requested": "native", "mode": "native", "reason": "asked for"}}
    assert "the run's held-out file" in result.output and "top_k 5" in result.output
    result = runner.invoke(app, ["eval", "--model", str(tiny_vlm_dir), "--n", "2", "--samples", "1",
                                 "--out", str(tmp_path / "plain.json")])
    assert result.exit_code == 0, result.output
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["n_prompts"] == 2 and plain["settings"]["max_new_tokens"] == 16  # EvalConfig's default
    assert plain["settings"]["top_k"] == 0 and "top_k off" in result.output  # off: the full vocabulary
    assert "procedural shapes test prompts" in result.output


def test_eval_seed_fixes_the_sampled_responses(tmp_path, tiny_vlm_dir):
    """The reward is −(characters of the response) / 40 (DAPO's soft overlong punishment with L_max = L_cache = 40,
    counted in characters): its mean moves with every sampled text, so equal numbers mean equal samples."""
    meta = {"max_length": 40, "cache_length": 40, "unit": "chars"}
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"id": f"q{k}", "task": "t", "prompt": f"Say {k} words.",
                                                          "reward": "overlong", "metadata": meta}) + "\n"
                                              for k in range(3)))
    outputs = []
    for seed in (5, 5, 6):
        result = runner.invoke(app, ["eval", "--model", str(tiny_vlm_dir), "--data", str(tmp_path / "t.jsonl"),
                                     "--samples", "4", "--max-new-tokens", "12", "--seed", str(seed),
                                     "--out", str(tmp_path / "e.json")])
        assert result.exit_code == 0, result.output
        outputs.append(json.loads((tmp_path / "e.json").read_text()))
    assert outputs[0]["reward"]["t"] < 0  # the texts are not empty: the measure moves
    assert outputs[0] == outputs[1]  # the same seed: the same samples, to the last digit
    assert outputs[2]["reward"] != outputs[0]["reward"] and outputs[2]["settings"]["seed"] == 6


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dapo_without_an_informative_group_warns_and_goes_on(tmp_path, tiny_vlm_dir, mode):
    """`vlrl rl --config configs/shapes_dapo.yaml` on prompts no model answers right (count answers of 987654321):
    every group's rewards are equal, so each step spends its cap of rounds, then trains on the last round's groups
    (zero advantage), logs sampling/starved = 1 and prints one warning line naming the knobs — no traceback."""
    import dataclasses

    from vlrl.data import generate, write_samples

    samples = [dataclasses.replace(s, answer="987654321") for s in generate("shapes", 8, split="train", tasks=["count"])]
    data = write_samples(samples, tmp_path / "data" / "flat.jsonl")
    test = write_samples(samples[:2], tmp_path / "data" / "test.jsonl")
    run = tmp_path / "run"
    result = runner.invoke(app, ["rl", "--config", "configs/shapes_dapo.yaml", "--data", str(data), "--test", str(test),
                                 f"model.path={tiny_vlm_dir}", f"rollout.mode={mode}", "train.steps=2",
                                 "train.prompts_per_step=2", "rollout.n=4", "algo.dynamic_sampling.max_extra_rounds=1",
                                 "train.log_every=1", "eval.samples=1", "report.html=false", f"out={run}"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    assert "Traceback" not in output and output.count("dynamic sampling found no group with differing rewards") == 2
    for knob in ("algo.dynamic_sampling.max_extra_rounds", "rollout.n", "rollout.temperature", "vlrl data select"):
        assert knob in output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        # cap 1 extra round: sync draws ceil(2 × 1.5) = 3 prompts per round, 2 rounds → 6 groups, 2 trained, 4
        # dropped; async drops one batch of 2, then trains the next 2 (the cap (1 + 1) × 2 = 4 reached)
        assert r["sampling/starved"] == 1.0 and r["sampling/prompts_used"] == 2
        assert r["sampling/groups_dropped"] == (4 if mode == "sync" else 2)
        assert r["policy/zero_adv_groups_frac"] == 1.0 and r["reward/mean"] == 0.0
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()


def test_hostile_and_broken_overrides_are_one_line_naming_the_override_or_field(tmp_path):
    """Issue 22's probes through the real `vlrl` entry point (a subprocess: no test-runner wrapping): each ends
    with exit 2 and one line on stderr, never a traceback; `.inf`/`.nan` anywhere (also inside betas and
    module_lr) and out-of-range seeds are refused at load; a `!!python` tag is refused by the YAML parser."""
    import sys

    cases = {
        "foo": "override 'foo': expected key=value",
        "a.b=[1,": "override 'a.b=[1,': the value is not valid YAML (expected the node content",
        "algo.kl_coef=!!python/object/apply:os.system [touch pwned]":
            "override 'algo.kl_coef=!!python/object/apply:os.system [touch pwned]': the value is not valid YAML",
        "nosuch.key=1": "config field 'nosuch': unknown field",
        "optim.lr=.inf": "config field 'optim.lr': Input should be a finite number",
        "rollout.temperature=.nan": "config field 'rollout.temperature': Input should be a finite number",
        "algo.kl_coef=-.inf": "config field 'algo.kl_coef': Input should be a finite number",
        "optim.betas=[0.9,.inf]": "config field 'optim.betas.1': Input should be a finite number",
        "optim.module_lr={visual: .nan}": "config field 'optim.module_lr.visual': Input should be a finite number",
        "seed=100000000000000000000000": "config field 'seed': Input should be less than 4294967296",
        "seed=-1": "config field 'seed': Input should be greater than or equal to 0",
    }
    for override, message in cases.items():
        done = forked_runs.run([sys.executable, "-m", "vlrl.cli", "rl", override, f"out={tmp_path / 'run'}"],
                               timeout=120, cwd=tmp_path)
        assert done.returncode == 2, (override, done.stderr[-1500:])
        assert done.stderr.strip().splitlines() == [done.stderr.strip()] and message in done.stderr, (override, done.stderr)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "run").exists()


def _command_paths():
    """Every command of the `vlrl` app as its words (``["data", "gen"]``), from typer's click object model."""
    import typer

    root = typer.main.get_command(app)
    paths = []

    def walk(cmd, names, parent):
        ctx = cmd.context_class(cmd, info_name=names[-1] if names else "vlrl", parent=parent)
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*names, name], ctx)
        else:
            paths.append(names)

    walk(root, [], None)
    return paths


def test_every_command_has_working_help():
    """`vlrl <command> --help` prints its usage for every command (typer 0.13-0.15 with click >= 8.2 crashed here:
    `make test-floor`, 2026-11-28, raised typer's floor to 0.16)."""
    paths = _command_paths()
    assert {"rl", "sft", "demo", "env"} <= {p[0] for p in paths}
    for words in paths:
        result = runner.invoke(app, [*words, "--help"])
        assert result.exit_code == 0 and "Usage" in result.output, (words, result.output, result.exception)
