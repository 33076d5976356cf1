"""The GPU check (issue 36 item 6): vlrl at a real shape on one lent GPU, in one `device` call of ≤ 8 minutes.

Random-weight Qwen2.5-VL-3B (and 7B when the GPU holds it) built from their published ``config.json``
(tests/fixtures/model_configs; `vlrl.models.config_only`: stand-in tokenizer and image processor) in bf16 on CUDA,
a GRPO step at a real shape — 8 prompts × n 8, 448² images (256 vision tokens each), 512 new tokens — measured piece
by piece:

- **the ceilings**: a bf16 8192³ matmul (median of 10 after 3 warm-ups, random data) and a 1 GiB device-to-device
  copy (bytes read + written) — the rates the figures below are compared with, beside the datasheet peak;
- **generation** (`vlrl.rollout.decode`, the in-process engine's loop; EOS suppressed so all 64 rows decode 512
  tokens): tokens/s, ms per decode step, and the step's memory bound (weights + the KV cache read once per step,
  over the measured copy bandwidth) — eager, and with ``rollout.engine.compile`` (a static cache, one decode step in a CUDA
  graph; its first call, the compile, timed apart);
- **sampler ≡ trainer**: max and mean |behaviour − teacher-forced| log-prob of the generated tokens in bf16;
- **the update** (`prepare_batch` + `ppo_update`, what a GRPO step runs after generation; rewards set so every group
  has a signal) for each arm — full fine-tuning and LoRA r=16, each with and without gradient checkpointing, pure
  bf16 weights — `perf/mfu` over the datasheet peak (and the measured matmul rate), seconds, and the peak GPU memory
  (``torch.cuda.max_memory_allocated``) beside `vlrl plan`'s estimate of the same step on one device.

Each measurement runs in its own ``try``: a failure (an out-of-memory arm, say) is written down and the rest go on.
A time budget (``--budget``) skips what would not fit, in priority order; the 7B model runs only when the budget and
the GPU's memory leave room. Output: ``OUT/gpu_check.json`` (every number, versions, device) and
``OUT/gpu_check.md`` (the table docs/gpu.md takes), the table also printed last.

**On a lent GPU** (one `device` call; docs/gpu.md). First, here, once: ``bash benchmarks/gpu_wheels.sh`` (the wheels
the device image lacks, into ``.whl/``, git-ignored). Then the `run` tool with ``carry: [".whl"]``,
``timeout_s: 420`` (7 minutes: with the machine's start, a second call still fits the task's 15 minutes of device
time) and this command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --out $OUT --budget 330

The 3B model's measurements take ~5 minutes (the compiled decode step's compile the longest); the 7B runs when the
budget leaves ~200 s — or alone in a second call: ``… gpu_check.py --out $OUT --models qwen2_5_vl_7b --budget 330``.

**On this CPU** (the test suite: tests/test_gpu_check.py): ``--smoke`` runs the same code on the tiny preset at a
tiny shape, one update step per arm, in about a minute.

    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "model_configs"
GiB = 2**30


@dataclass(frozen=True)
class Shape:
    prompts: int
    n: int
    new_tokens: int
    side: int  # image side, pixels
    micro_batch: int


REAL = Shape(prompts=8, n=8, new_tokens=512, side=448, micro_batch=8)
SMOKE = Shape(prompts=2, n=2, new_tokens=4, side=112, micro_batch=4)
# The update arms: (name, LoRA rank or None, gradient checkpointing), in the order they run — the configurations a
# user would pick first (checkpointing on) before the compiled decode step (its compile is the longest and least
# predictable measurement), the others after it. A LoRA arm's adapters are removed again when it ends.
ARMS = [("full, checkpointing", None, True), ("LoRA r=16, checkpointing", 16, True), ("full", None, False),
        ("LoRA r=16", 16, False)]
COMPILE_AFTER = 2  # the rollout.engine.compile measurement runs after this many arms


# ----------------------------------------------------------------------------------------------- ceilings
def ceilings(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Measured bf16 (fp32 on CPU) matmul rate and device-to-device copy bandwidth, and the datasheet peak."""
    from vlrl.report.perf import device_peak

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 1024 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for k in range(13):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if k >= 3:
            times.append(time.perf_counter() - start)
    matmul = 2 * n**3 / statistics.median(times)
    nbytes = (64 if smoke else 1024) * 2**20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for k in range(8):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if k >= 3:
            times.append(time.perf_counter() - start)
    peak = device_peak(device, dtype)
    return {"matmul_tflops": matmul / 1e12, "copy_gbs": 2 * nbytes / statistics.median(times) / 1e9,
            "datasheet_tflops": peak.tflops, "peak_source": peak.source}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------------------------- model + data
def build_policy(model: str, device: torch.device, smoke: bool):
    """The random-weight policy: a fixture config in bf16 on the GPU, or the tiny preset (fp32) for --smoke."""
    from vlrl.models import load_policy
    from vlrl.models.config_only import stand_in_policy

    if smoke:
        return load_policy("tiny-qwen2-vl", device=str(device))
    return stand_in_policy(FIXTURES / f"{model}.json", device=device, dtype=torch.bfloat16)


def requests(policy, shape: Shape):
    from vlrl.data import generate
    from vlrl.rollout import HFEngine

    engine = HFEngine(policy)
    samples = generate("shapes", shape.prompts, tasks=["count", "color"], image_size=shape.side)
    return [engine.encode(s) for s in samples]


# ----------------------------------------------------------------------------------------------- generation
def generation(policy, prompts, shape: Shape, ceiling: dict, *, compiled: bool,
               backend: str = "inductor") -> tuple[dict, list]:
    """One rollout of ``shape`` (EOS suppressed: every row decodes ``new_tokens``); with ``compiled``, a first call
    compiles the step and the second is measured. Returns (figures, per-row (tokens, behaviour log-probs))."""
    from vlrl.rollout import SamplingParams, decode

    model = policy.model
    model.eval()
    rows = [r for r in prompts for _ in range(shape.n)]
    eos = model.config.image_token_id  # a suppressed token: never sampled, so every row runs to the budget
    suppress = sorted(set(policy.adapter.special_token_ids()) - set(policy.eos_token_ids))
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=shape.new_tokens)
    step = decode.CompiledStep(backend=backend) if compiled else None
    out: dict[str, Any] = {}
    device = next(model.parameters()).device

    def run():
        stats = decode.DecodeStats()
        _sync(device)
        start = time.perf_counter()
        decoded = decode.sample(model, policy.adapter, rows, sampling, pad_token_id=policy.pad_token_id,
                                eos_token_ids=[eos], suppress=suppress, stats=stats, compiled=step)
        _sync(device)
        return decoded, stats, time.perf_counter() - start

    if compiled:
        _, _, first = run()
        out["compile_and_first_rollout_s"] = first
    decoded, stats, seconds = run()
    tokens = sum(len(t) for t in decoded.tokens)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    prompt = max(len(r.prompt_ids) for r in rows)
    kv_per_token = 2 * text.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
    kv_mean = kv_per_token * len(rows) * (prompt + shape.new_tokens / 2)  # the cache read once per step, on average
    bound_ms = (params + kv_mean) / (ceiling["copy_gbs"] * 1e9) * 1e3
    ms = stats.decode_seconds / max(stats.steps - 1, 1) * 1e3
    out.update(rollout_s=seconds, tokens=tokens, tokens_per_s=tokens / seconds, prefill_s=stats.prefill_seconds,
               decode_s=stats.decode_seconds, decode_steps=stats.steps, decode_ms_per_step=ms,
               hbm_bound_ms_per_step=bound_ms, bound_share=bound_ms / ms, prompt_tokens=prompt, rows=len(rows),
               peak_memory_gib=_peak_memory(device))
    return out, list(zip(decoded.tokens, decoded.logp, strict=True))


def trajectories(prompts, decoded, shape: Shape):
    """The rollout as `Trajectory` records, rewards 0.1·k within each group (every group has a signal)."""
    from vlrl.rollout.types import Status, Trajectory

    out = []
    for k, (tokens, logp) in enumerate(decoded):
        request = prompts[k // shape.n]
        out.append(Trajectory(sample=request.sample, prompt_ids=torch.as_tensor(request.prompt_ids),
                              response_ids=torch.tensor(tokens, dtype=torch.long),
                              loss_mask=torch.ones(len(tokens), dtype=torch.long), behaviour_logp=logp.float().cpu(),
                              vision=request.vision, images=request.images, weight_version=0,
                              status=Status.TRUNCATED, response_text="", group_index=k // shape.n,
                              reward=0.1 * (k % shape.n)))
    return out


def drift(policy, rows, micro_batch: int) -> dict[str, float]:
    """|teacher-forced − behaviour| log-prob over every generated token (the sampler ≡ trainer check, bf16), the
    teacher-forced pass in micro-batches (its fp32 logits: rows × R × V × 4 bytes)."""
    from vlrl.train.batch import teacher_logprobs

    gaps = []
    for start in range(0, len(rows), micro_batch):
        part = rows[start : start + micro_batch]
        with torch.no_grad():
            logp = teacher_logprobs(policy.model, policy, part, 1.0).float().cpu()
        gaps += [(logp[i, : len(t.behaviour_logp)] - t.behaviour_logp).abs() for i, t in enumerate(part)]
    gaps = torch.cat(gaps)
    return {"logp_drift_max": float(gaps.max()), "logp_drift_mean": float(gaps.mean()),
            "logp_drift_p99": float(gaps.quantile(0.99))}


# ----------------------------------------------------------------------------------------------- updates
def stage_for(shape: Shape, lora: int | None, checkpointing: bool, extra: list[str]):
    from vlrl.config import RLStage, RLTrainConfig, apply_overrides

    raw: dict[str, Any] = {"rollout": {"n": shape.n, "max_new_tokens": shape.new_tokens},
                           "train": {"prompts_per_step": shape.prompts, "micro_batch_size": shape.micro_batch,
                                     "gradient_checkpointing": checkpointing},
                           "optim": {"lr": 1e-6}}
    if "logprob_chunk" in RLTrainConfig.model_fields:  # the chunked LM head (issue 36 item 1), where it exists
        raw["train"]["logprob_chunk"] = "auto"
    apply_overrides(raw, extra, cls=RLStage)
    return RLStage.model_validate(raw)


def update(policy, rows, shape: Shape, lora: int | None, checkpointing: bool, steps: int, extra: list[str],
           ceiling: dict) -> dict[str, Any]:
    """``steps`` update phases of one arm (the first one warms up and is left out of the timings)."""
    from vlrl.config import LoraConfig
    from vlrl.models.lora import apply_lora
    from vlrl.train.batch import build_algorithm, prepare_batch
    from vlrl.train.budget import PhaseMeter
    from vlrl.train.common import make_optimizer
    from vlrl.train.modules import stage_modules
    from vlrl.train.update import ppo_update

    device = next(policy.model.parameters()).device
    if lora is not None and policy.lora is None:
        apply_lora(policy, LoraConfig(r=lora, alpha=2 * lora))
    stage = stage_for(shape, lora, checkpointing, extra)
    _reset_memory(device)
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    measured = []
    with stage_modules(policy, stage.train) as modules:
        optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups)
        for step in range(steps):
            with PhaseMeter(policy.model, device, next(policy.model.parameters()).dtype) as perf:
                perf.begin()
                batch = prepare_batch(algorithm, policy, rows, step=step, max_new_tokens=shape.new_tokens)
                ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=step)
                _sync(device)
                perf.phase("")
                flops, seconds = perf._phases[""]
                measured.append({**perf.metrics(), "seconds": seconds, "tflop": flops / 1e12})
        out = {"trainable_params": modules.trainable_params, "gradient_checkpointing": modules.gradient_checkpointing}
    timed = measured[1:] or measured
    seconds = statistics.median(m["seconds"] for m in timed)
    out.update(update_s=seconds, tflop=timed[0]["tflop"], tflops=timed[0]["tflop"] / seconds,
               mfu=statistics.median(m.get("perf/mfu", 0.0) for m in timed),
               mfu_of_measured=timed[0]["tflop"] / seconds / max(ceiling["matmul_tflops"], 1e-9),
               peak_memory_gib=_peak_memory(device), steps=steps)
    optimizer.zero_grad(set_to_none=True)
    if policy.lora is not None:  # the next arm starts from the base model again
        policy.model, policy.lora = policy.lora.unload(), None
    return out


def planned(model: str, shape: Shape, lora: int | None, checkpointing: bool, memory_gib: float | None = None
            ) -> dict[str, float]:
    """`vlrl plan`'s estimate for this step on one device: the train phase (state + activations + logits) and the
    generate phase (parameters + KV cache), GiB — what ``torch.cuda.max_memory_allocated`` is compared with."""
    from vlrl.config import RLConfig, load_config
    from vlrl.launch import planner

    overrides = [f"model.path={FIXTURES / f'{model}.json'}", "model.dtype=bfloat16", f"rollout.n={shape.n}",
                 f"train.prompts_per_step={shape.prompts}", f"rollout.max_new_tokens={shape.new_tokens}",
                 f"train.micro_batch_size={shape.micro_batch}", f"rollout.engine.max_batch_size={shape.prompts * shape.n}",
                 f"train.gradient_checkpointing={str(checkpointing).lower()}", "data.tasks=[count,color]",
                 f"data.suite_options={{image_size: {shape.side}}}", "algo.kl_coef=0"]
    if lora is not None:
        overrides += [f"model.lora.r={lora}", f"model.lora.alpha={2 * lora}"]
    cfg = load_config(RLConfig, None, overrides)
    meta, adapter = planner.meta_model(cfg.model.path)
    shape_ = planner.model_shape(meta)
    work = planner.workload(cfg, adapter, model=meta)
    state = sum(t.value for t in planner.trained_state(shape_, work, 1, "actor"))
    train = sum(t.value for t in planner.activations(shape_, work))
    gen = sum(t.value for t in planner.generation(shape_, work, work.sequences))
    return {"plan_train_gib": (state + train) / GiB, "plan_generate_gib": (state + gen) / GiB,
            "plan_prompt_tokens": work.prompt_tokens}


# ----------------------------------------------------------------------------------------------- the run
SAVE = None  # set by `main`: writes gpu_check.json as it stands


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def attempt(results: dict, key: str, fn, budget: Budget, needs: float) -> Any:
    """Run ``fn`` into ``results[key]`` if ``needs`` seconds are left; a failure is recorded, not raised."""
    if budget.left() < needs:
        results[key] = {"skipped": f"time budget: {budget.left():.0f} s left, ~{needs:.0f} s needed"}
        return None
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as err:  # an OOM or a compile failure must not lose the other figures
        results[key] = {"error": f"{type(err).__name__}: {str(err)[:400]}", "traceback": traceback.format_exc()[-2000:]}
        print(f"[{key}] failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    results[key] = value[0] if isinstance(value, tuple) else value
    results[key]["wall_s"] = time.perf_counter() - start
    print(f"[{key}] {json.dumps(results[key], default=str)[:600]}", flush=True)
    if SAVE is not None:  # after every measurement: a run stopped at its time limit keeps what it measured
        SAVE()
    return value


def check_model(model: str, shape: Shape, device: torch.device, ceiling: dict, budget: Budget, args,
                arms: list = ARMS) -> dict:
    results: dict[str, Any] = {}
    seconds = {"build": 60, "generate": 90, "compiled": 150, "update": 60}
    if args.smoke:
        seconds = dict.fromkeys(seconds, 0)
    policy = attempt(results, "build", lambda: _built(model, device, args.smoke), budget, seconds["build"])
    if policy is None:
        return results
    policy = policy[1]  # (figures, policy)
    prompts = requests(policy, shape)
    got = attempt(results, "generate (eager)", lambda: generation(policy, prompts, shape, ceiling, compiled=False),
                  budget, seconds["generate"])
    if got is None:
        return results
    rows = trajectories(prompts, got[1], shape)
    attempt(results, "sampler ≡ trainer (bf16)" if not args.smoke else "sampler ≡ trainer", lambda: drift(policy, rows, shape.micro_batch),
            budget, 10)
    memory = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    for k, arm_spec in enumerate([*arms, None]):
        if k == min(COMPILE_AFTER, len(arms)) and not args.no_compile:  # no adapters in the model at this point
            attempt(results, "generate (rollout.engine.compile)", lambda: generation(
                policy, prompts, shape, ceiling, compiled=True, backend=args.compile_backend), budget,
                seconds["compiled"])
        if arm_spec is None:
            break
        name, lora, checkpointing = arm_spec
        plan = planned(model, shape, lora, checkpointing, memory) if not args.smoke else {}
        if memory is not None and plan["plan_train_gib"] > 0.97 * memory:  # vlrl plan says it does not fit
            results[f"update: {name}"] = {"skipped": f"vlrl plan: {plan['plan_train_gib']:.0f} GiB > {memory:.0f}",
                                          **plan}
            continue

        def arm(lora=lora, checkpointing=checkpointing, plan=plan):
            return {**update(policy, rows, shape, lora, checkpointing, 1 if args.smoke else 2, args.set, ceiling),
                    **plan}
        attempt(results, f"update: {name}", arm, budget, seconds["update"])
    policy.model.to("meta")  # frees the weights before the next model (the policy is not used again)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _built(model: str, device: torch.device, smoke: bool):
    start = time.perf_counter()
    policy = build_policy(model, device, smoke)
    _sync(device)
    return ({"parameters_b": policy.num_parameters() / 1e9, "build_s": time.perf_counter() - start,
             "memory_gib": _peak_memory(device)}, policy)


def versions() -> dict[str, str]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": str(torch.version.cuda)}
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:
        out["peft"] = "missing"
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset at a tiny shape (runs on a CPU)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds for everything; what would not fit is skipped")
    parser.add_argument("--models", nargs="*", default=["qwen2_5_vl_3b", "qwen2_5_vl_7b"])
    parser.add_argument("--no-compile", action="store_true", help="leave out the rollout.engine.compile arm")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of that arm")
    parser.add_argument("--set", nargs="*", default=[], help="RL stage overrides for the update arms")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)  # a tiny model gains nothing from a second thread on a shared machine
    budget = Budget(args.budget)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = SMOKE if args.smoke else REAL
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                              f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
                              "memory_gib": (torch.cuda.get_device_properties(device).total_memory / GiB
                                             if device.type == "cuda" else None),
                              "shape": vars(shape), "smoke": args.smoke, "models": {}}
    global SAVE
    SAVE = lambda: (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))  # noqa: E731
    report["ceilings"] = ceilings(device, args.smoke)
    print(f"device {report['device']}, versions {report['versions']}, ceilings {report['ceilings']}", flush=True)
    models = ["tiny-qwen2-vl"] if args.smoke else args.models
    for k, model in enumerate(models):
        arms = ARMS  # (an arm `vlrl plan` says does not fit the GPU is skipped, with the plan's figure)
        if k and not args.smoke:  # a bigger model only with the time for it
            if budget.left() < 200:
                report["models"][model] = {"skipped": f"time budget: {budget.left():.0f} s left, ~200 s needed"}
                continue
        report["models"][model] = check_model(model, shape, device, report["ceilings"], budget, args, arms)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    report["wall_s"] = budget.seconds - budget.left()
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (out_dir / "gpu_check.md").write_text(table)
    print("\n" + table, flush=True)
    return report


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "–"


def markdown(report: dict) -> str:
    c = report["ceilings"]
    s = report["shape"]
    lines = [f"GPU check, {report['date']}: {report['device']}"
             + (f" ({report['memory_gib']:.0f} GiB)" if report["memory_gib"] else "")
             + f"; {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
             f"shape: {s['prompts']} prompts × n {s['n']}, {s['side']}² images, {s['new_tokens']} new tokens, "
             f"micro-batches of {s['micro_batch']}; measured matmul {c['matmul_tflops']:.3g} TFLOP/s "
             f"({c['peak_source']}: {c['datasheet_tflops']:.3g}), copy {c['copy_gbs']:.0f} GB/s",
             "",
             "| model | measurement | figures |", "| --- | --- | --- |"]
    for model, results in report["models"].items():
        if "skipped" in results:
            lines.append(f"| {model} | – | skipped: {results['skipped']} |")
            continue
        for key, r in results.items():
            if "skipped" in r or "error" in r:
                lines.append(f"| {model} | {key} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error'][:160]} |")
            elif key == "build":
                lines.append(f"| {model} | build | {r['parameters_b']:.2f}B parameters in {r['build_s']:.0f} s |")
            elif key.startswith("generate"):
                extra = (f"; first call (compile) {r['compile_and_first_rollout_s']:.0f} s"
                         if "compile_and_first_rollout_s" in r else "")
                lines.append(f"| {model} | {key} | {r['tokens_per_s']:.0f} tokens/s ({r['rows']} rows × "
                             f"{r['decode_steps']} steps, prompt {r['prompt_tokens']} tokens); decode "
                             f"{r['decode_ms_per_step']:.1f} ms/step vs {r['hbm_bound_ms_per_step']:.1f} ms memory "
                             f"bound ({r['bound_share']:.0%}); prefill {r['prefill_s']:.2f} s; peak "
                             f"{_fmt(r['peak_memory_gib'], '.1f')} GiB{extra} |")
            elif key.startswith("sampler"):
                lines.append(f"| {model} | {key} | max {r['logp_drift_max']:.3f}, p99 {r['logp_drift_p99']:.3f}, "
                             f"mean {r['logp_drift_mean']:.4f} nats |")
            elif key.startswith("update"):
                plan = (f" (plan: {r['plan_train_gib']:.1f} GiB train, {r['plan_generate_gib']:.1f} generate)"
                        if "plan_train_gib" in r else "")
                lines.append(f"| {model} | {key} | {r['update_s']:.2f} s/update, {r['tflops']:.3g} TFLOP/s, MFU "
                             f"{r['mfu']:.1%} of datasheet ({r['mfu_of_measured']:.1%} of measured matmul); peak "
                             f"{_fmt(r['peak_memory_gib'], '.1f')} GiB{plan} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
