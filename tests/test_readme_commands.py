"""Every command in the ```bash blocks of the README and of the documentation site (docs/, in the site's nav
order) that a user can run here is run, in that order, in one working directory (with the shipped `configs/`),
with tiny overrides where it trains — and must exit 0. The rest are listed in `NOT_RUN` with the reason; a command
that is neither run nor listed fails the test, and so does a `NOT_RUN` entry that matches no command. So neither
the README nor the docs can drift from the code.

The pages of measurements (docs/experiments/, docs/benchmarks/, docs/gpu.md) are not run — their commands take
minutes to hours and their numbers are on the page — but parsed and validated: a `vlrl` command must name an
existing command and options, a `python benchmarks/X.py` an existing script, a `make` target a Makefile target.

The commands run in this process (the `vlrl` app through typer's runner, as `vlrl` would run it); the servers a
block starts with `&` run as subprocesses on free ports (the page's port numbers are replaced everywhere in
the block's later commands), and are stopped at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
MEASURED = ("docs/experiments/", "docs/benchmarks/", "docs/gpu.md")  # validated, not run


def doc_pages() -> list[Path]:
    """The README, then every page of the site in its nav order (mkdocs.yml): the order a reader meets them."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def walk(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [p for value in entry.values() for p in walk(value)]
        return [p for item in entry for p in walk(item)]

    return [README, *(ROOT / "docs" / page for page in walk(nav))]


def _measured(page: Path) -> bool:
    return page.relative_to(ROOT).as_posix().startswith(MEASURED)


def all_commands(measured: bool = False) -> list[list[str]]:
    """The commands of the pages that are run (``measured=False``) or only validated (``measured=True``)."""
    return [argv for page in doc_pages() if _measured(page) == measured
            for argv in readme_commands(page.read_text())]

# A README or docs command (its start, after joining continuation lines and dropping comments) → why it is not run here.
NOT_RUN = {
    "make demo": "the full demo takes 14–48 minutes on 2 shared cores (docs/experiments/demo.md, 2026-12-07); the same recipe runs tiny in tests/report/test_html.py and tests/test_numerics.py, its quick configuration in tests/e2e/test_demo.py",
    "make test": "runs this test suite",
    "pip install -e .[docs] && mkdocs serve": "a web server; tests/test_docs.py builds the same site strictly",
    "vlrl plan configs/recipes/qwen2_5_vl_7b_lora_grpo.yaml": "reads Qwen2.5-VL-7B's config.json from the hub (no "
    "network here); `vlrl plan` on that config.json as a fixture: tests/models/test_config_only.py",
    "vlrl rl --config configs/recipes/qwen2_5_vl_7b_lora_grpo.yaml": "a GPU and a hub download (the recipe runs "
    "with its family's tiny preset in tests/test_shipped_configs.py)",
    "source .venv/bin/activate": "a shell builtin: these tests run inside the environment it activates",
    "vlrl check configs/shapes_sft.yaml --data sft.jsonl": "your own files (sft.jsonl, rl.jsonl, test.jsonl); "
    "tests/test_newcomer.py runs this path on real images",
    "vlrl sft --config configs/shapes_sft.yaml --data sft.jsonl": "your own files; tests/test_newcomer.py",
    "vlrl data select --data rl.jsonl": "your own files; tests/test_newcomer.py",
    "vlrl rl --config configs/shapes_grpo.yaml --data data/rl_selected/selected.jsonl": "your own files; "
    "tests/test_newcomer.py",
    "vlrl eval --model runs/mine_rl/checkpoints/final": "your own run; tests/test_newcomer.py",
    "vlrl report runs/mine_sft runs/mine_rl": "your own runs; tests/test_newcomer.py",
    "vlrl rl --config configs/judge_grpo.yaml rollout.agent.env_kwargs.judge=/path/to/judge-model": "a judge model "
    "directory on your machine (the config's own judge, tiny-qwen2, is what tests/rollout run)",
    "pip install torch --index-url https://download.pytorch.org/whl/cu128": "installs a CUDA build of torch",
    "vlrl rl --config configs/shapes_grpo.yaml model.path=Qwen/Qwen2.5-VL-3B-Instruct": "a GPU and a hub download",
    "vlrl rl --config configs/shapes_grpo.yaml model.path=Qwen/Qwen3-VL-8B-Instruct": "a GPU and a hub download "
    "(every family's tiny preset saved to a directory runs this path: tests/models/test_families_cli.py)",
    "export VLRL_API_KEY=": "the test sets VLRL_API_KEY itself (a random token, as this line makes)",
    "python -m sglang.launch_server": "a real SGLang server on a GPU",
    "torchrun --standalone --nproc_per_node 8": "8 GPUs and a hub download",
    "torchrun --nnodes 2": "two machines with 8 GPUs each",
    "vlrl launch --ray auto": "a Ray cluster with GPUs (6 + 2 or 16 in the examples)",
    "vlrl launch --ray local --nproc 2 configs/shapes_grpo.yaml launch.rollout_servers=1 rollout.weight_sync.method="
    "distributed": "tests/train/test_launch_servers.py runs this launch (`vlrl launch --ray local` of shapes_grpo.yaml, "
    "2 ranks, launch.rollout_servers=1, rollout.weight_sync.method=distributed) and asserts more of it: 3 steps, the "
    "server ending with the exported weights by broadcast, every actor stopped; `--nproc 2` reaches launch.nproc in "
    "the SFT launch above, which runs here (a second Ray launch cost ~2 min of this test under load)",
    "vlrl serve --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda": "a GPU and a hub download (`vlrl serve` of a "
    "preset beside torchrun ranks: tests/train/test_servers_ranks.py)",
    "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 torchrun": "6 GPUs beside the two servers above",
    "vlrl plan configs/shapes_lora_grpo.yaml --gpus 1 --gpu-mem 80 model.path=Qwen/Qwen2.5-VL-7B-Instruct": "reads "
    "the model's config.json from the Hugging Face hub (no network here); the memory guide's table under it was computed "
    "from a local copy of that config.json, and tests/launch/test_planner.py covers LoRA + checkpointing",
    "vlrl plan configs/shapes_grpo.yaml --gpus 8 --gpu-mem 80 model.path=Qwen/Qwen2.5-VL-7B-Instruct": "reads "
    "Qwen2.5-VL-7B's config from the hub (`vlrl plan` on the tiny presets: tests/launch/test_planner.py)",
    "vlrl synth serve --backend diffusers": "an inpainting model directory (/models/sd-inpaint) and a GPU",
    "vlrl data balance --data pool.jsonl": "your pool and a CLIP model directory (/models/clip-vit-b32)",
    "vlrl data pack --data data/balanced/train.jsonl --model Qwen/Qwen2-VL-2B-Instruct": "the balanced pool of the "
    "line above and Qwen2-VL-2B's tokenizer from the hub (`vlrl data pack` on a preset: tests/test_cli.py)",
    "vlrl data select --data rl_pool.jsonl": "your prompt pool (`vlrl data select` on real images: "
    "tests/test_newcomer.py)",
    "python benchmarks/exp_step_credit.py": "an experiment of many minutes (docs/experiments/step_credit.md)",
    "vlrl reward score --data samples.jsonl --responses responses.jsonl": "your samples and responses files "
    "(tests/rewards/test_cli.py scores files through this command)",
    "make .venv-vllm": "builds vLLM's own environment (minutes; `make test` builds it first, and tests/rollout/"
    "test_vllm_live.py and test_vllm_conformance.py run against it)",
    "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server":
    "a vLLM server (1-4 minutes to start here): tests/rollout/test_vllm_live.py starts one the same way, through "
    "vlrl's launcher, and runs the `vlrl rl` below on it",
    "vlrl rl --config configs/arith_grpo.yaml model.path=runs/my_sft/checkpoints/final": "the vLLM server above; "
    "tests/rollout/test_vllm_live.py runs this command on a saved tiny-qwen2 (engine=vllm, and engine=auto)",
    "vlrl rl --config configs/arith_grpo.yaml rollout.servers.engine=vllm rollout.servers.launch.count=1": "starts a "
    "vLLM server (minutes): tests/rollout/test_vllm_live.py starts one with the same launcher, and "
    "tests/rollout/test_engine_launch.py runs `vlrl rl` launching its own `vlrl serve`",
}

SFT_TINY = ["train.steps=1", "train.batch_size=2", "train.micro_batch_size=2", "train.log_every=1"]
RL_TINY = ["train.steps=1", "train.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
           "train.micro_batch_size=4", "train.log_every=1"]
RUN_TINY = ["data.n_train=16", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=2",
            "check.samples_per_task=1", "report.html=false"]


def readme_commands(text: str) -> list[list[str]]:
    """The README's ```bash commands as argv lists, in order: continuation lines joined, comments dropped,
    ``for X in a b; do … done`` loops expanded."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [shlex.split(line, comments=True) for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
        lines = [argv for argv in lines if argv]
        k = 0
        while k < len(lines):
            argv = lines[k]
            if argv[0] == "for" and argv[2] == "in" and argv[-1] == "do":
                variable, values = argv[1], [v.rstrip(";") for v in argv[3:-1] if v != ";"]
                end = next(j for j in range(k, len(lines)) if lines[j] == ["done"])
                for value in values:
                    commands += [[a.replace(f"${variable}", value) for a in body] for body in lines[k + 1:end]]
                k = end + 1
                continue
            commands.append(argv)
            k += 1
    return commands


def _not_run(argv: list[str]) -> str | None:
    line = " ".join(argv)
    return next((key for key in NOT_RUN if line.startswith(key)), None)


def test_every_readme_command_is_run_or_listed():
    """The classification alone (fast): every command of the README and the docs' guides is run by the e2e test
    below or listed with a reason, and every listed reason still matches a command."""
    commands = all_commands()
    assert len(commands) > 30
    unmatched = [" ".join(argv) for argv in commands if argv[0] != "vlrl" and _not_run(argv) is None]
    assert not unmatched, f"commands that are neither vlrl commands nor listed in NOT_RUN: {unmatched}"
    stale = [key for key in NOT_RUN if not any(" ".join(argv).startswith(key) for argv in commands)]
    assert not stale, f"NOT_RUN entries that match no README or docs command any more: {stale}"
    assert [" ".join(a) for a in readme_commands(README.read_text())][:2] == ["make demo", "make test"]


def _validate(argv: list[str]) -> str | None:
    """Why a command that is not run would not work as written (None: it would parse): a `vlrl` command must name
    an existing (sub)command and its options, a script an existing file, a make target a Makefile target."""
    import typer

    from vlrl.cli import app

    while argv and re.match(r"[A-Z_]+=", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if not argv or argv[0] in ("export", "source"):
        return None
    if argv[0] == "make":
        targets = re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), re.M)
        return None if argv[1] in targets else f"no make target {argv[1]}"
    if argv[0] == "python" and argv[1].endswith(".py"):
        return None if (ROOT / argv[1]).is_file() else f"no script {argv[1]}"
    if argv[0] != "vlrl":
        return None
    command, k = typer.main.get_command(app), 1
    while hasattr(command, "list_commands") and k < len(argv):  # a group (typer carries its own copy of click)
        sub = command.get_command(command.context_class(command), argv[k])
        if sub is None:
            return f"no command {' '.join(argv[:k + 1])}"
        command, k = sub, k + 1
    if hasattr(command, "list_commands"):
        return None  # `vlrl data` alone prints its help
    options = {o for p in command.params for o in [*p.opts, *p.secondary_opts]}
    unknown = [a.split("=")[0] for a in argv[k:] if a.startswith("--") and a.split("=")[0] not in options]
    return f"unknown options {unknown}" if unknown else None


def test_every_listed_or_measured_command_parses():
    """The commands that are not run — listed in NOT_RUN, or on the measurement pages — name commands, options,
    scripts and make targets that exist."""
    listed = [argv for argv in all_commands() if _not_run(argv) is not None]
    measured = all_commands(measured=True)
    assert measured, "the measurement pages lost their commands"
    problems = [f"{' '.join(argv)}: {why}" for argv in [*listed, *measured] if (why := _validate(argv))]
    assert not problems, problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny(argv: list[str]) -> list[str]:
    """The command with tiny sizes: overrides appended (the last value wins), sizes of data generation capped."""
    command = argv[1] if len(argv) > 1 else ""
    if command in ("sft", "rl", "launch"):
        config = next((argv[k + 1] for k, a in enumerate(argv) if a in ("--config", "-c")), None)
        if command == "launch":
            config = next(a for a in argv[2:] if a.endswith(".yaml"))
        raw = yaml.safe_load(Path(config).read_text()) if config else {}
        recipe = "rl" if command == "rl" or "rollout" in raw else "sft"
        tiny = SFT_TINY if recipe == "sft" else RL_TINY
        stages = raw.get("stages") or []
        extra = [f"stages.{k}.{o}" for k, stage in enumerate(stages) for o in tiny + (
            ["data.n_train=16"] if stage.get("data") else [])] if stages else list(tiny)
        if (raw.get("algo") or {}).get("dynamic_sampling", {}).get("enabled"):
            # after one SFT step every group scores 0: each step spends its rounds and goes on starved (a warning
            # line, tests/test_cli.py); one extra round keeps that short
            extra.append("algo.dynamic_sampling.max_extra_rounds=1")
        return [*argv, *extra, *RUN_TINY]
    if command == "data" and argv[2] == "gen":
        out = list(argv)
        for k, a in enumerate(out):
            if a == "--n":
                out[k + 1] = str(min(int(out[k + 1]), 16))
        return out
    if command == "eval":
        return [*argv, "--samples", "1", "--max-new-tokens", "2", "--n", "2"]
    return list(argv)


def _start_server(argv: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """A `vlrl … serve` line ending in ``&``: a subprocess; returns once its /health answers."""
    import urllib.request

    port = argv[argv.index("--port") + 1]
    process = subprocess.Popen([sys.executable, "-m", "vlrl.cli", *argv[1:]], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{' '.join(argv)} exited {process.returncode}: {process.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError(f"{' '.join(argv)}: no /health after 180 s")


@pytest.mark.e2e
def test_readme_commands_run(tmp_path, monkeypatch):
    from vlrl.cli import app

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    token = "readme-test-token"
    monkeypatch.setenv("VLRL_API_KEY", token)
    env = {**os.environ, "VLRL_API_KEY": token, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    runner = CliRunner()
    ports: dict[str, str] = {}  # the page's port → free port, for the servers and every later command naming them
    servers: list[subprocess.Popen] = []
    ran = []
    try:
        for argv in all_commands():
            if _not_run(argv) is not None:
                continue
            argv = [re.sub(r"\b(30\d\d\d)\b", lambda m: ports.get(m.group(1), m.group(1)), a) for a in argv]
            if argv[-1] == "&":
                argv = argv[:-1]
                readme_port = argv[argv.index("--port") + 1]
                ports[readme_port] = str(_free_port())
                argv[argv.index("--port") + 1] = ports[readme_port]
                servers.append(_start_server(argv, env, tmp_path))
                ran.append(" ".join(argv))
                continue
            command = _tiny(argv)
            result = runner.invoke(app, command[1:])
            assert result.exit_code == 0, f"`{' '.join(argv)}` exited {result.exit_code}:\n{result.output}"
            ran.append(" ".join(argv))
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    # what the commands made, by the README's own paths
    assert (tmp_path / "runs" / "shapes_grpo" / "report.html").is_file()  # `vlrl report runs/shapes_grpo`
    assert (tmp_path / "compare.html").is_file()
    assert (tmp_path / "runs" / "three_stage_sft" / "checkpoints" / "instruct").is_dir()
    assert any(line.startswith("vlrl rl --config configs/shapes_remax.yaml") for line in ran)
    assert len(ran) >= 25, ran


def test_the_plain_transformers_snippet_matches_vlrl(tmp_path, monkeypatch, tiny_vlm_dir):
    """The own-data guide's "Run a checkpoint in plain transformers" code, run as written on a saved checkpoint: its
    prompt tokens are vlrl's, its first generated token's logits equal vlrl's own forward pass, and leaving
    mm_token_type_ids out of `generate` changes them without an error (a forward call without it raises;
    `generate` goes on with wrong positions)."""
    import contextlib
    import io

    import torch

    from vlrl.data import generate, load_image
    from vlrl.models import load_policy

    guide = ROOT / "docs" / "guides" / "own-data.md"
    code = re.search(r"## Run a checkpoint in plain transformers.*?```python\n(.*?)```", guide.read_text(), re.S)
    assert code, "the own-data guide lost its plain-transformers example"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "mine_rl" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "mine_rl" / "checkpoints" / "final").symlink_to(tiny_vlm_dir, target_is_directory=True)
    sample = generate("shapes", 1, split="test", tasks=["count"])[0]
    image = load_image(sample.images[0])
    (tmp_path / "images").mkdir()
    image.save(tmp_path / "images" / "q-0001.png")
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code.group(1), str(guide), "exec"), namespace)  # noqa: S102 (the guide's own example)
    assert printed.getvalue().strip() != "" or namespace["output"].shape[1] > namespace["inputs"]["input_ids"].shape[1]

    policy = load_policy(str(tiny_vlm_dir))
    encoded = policy.adapter.encode_prompt(namespace["messages"], [image.convert("RGB")])
    inputs, vision, model = namespace["inputs"], namespace["vision"], namespace["model"]
    assert inputs["input_ids"][0].tolist() == encoded.input_ids
    ids = torch.tensor([encoded.input_ids])
    with torch.no_grad():
        reference = policy.model(**policy.adapter.forward_inputs(policy.model, ids, torch.ones_like(ids),
                                                                 encoded.vision)).logits[0, -1]

        def first_logits(kwargs):
            out = model.generate(**kwargs, **vision, max_new_tokens=1, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            return out.logits[0][0]

        ours = first_logits(inputs)
        without = first_logits({k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
    assert torch.allclose(ours, reference, atol=1e-4)
    assert (without - reference).abs().max() > 1e-3
