"""`vlrl launch` (ranks as Ray actors) and `vlrl plan` (placements, their memory and step time)."""

from __future__ import annotations

from pathlib import Path

import typer

from vlrl.cli.app import app
from vlrl.cli.common import OVERRIDES, RECIPES, RESUME, load_run, recipe_of
from vlrl.config import ConfigError


@app.command()
def launch(
    config: Path = typer.Argument(..., help="The YAML config of the run (sft or rl); its launch section places the ranks."),
    overrides: list[str] | None = OVERRIDES,
    ray_address: str = typer.Option("local", "--ray", help="Ray cluster address (e.g. auto, ray://head:10001), or "
                                    "local: start a one-node Ray here."),
    nproc: int | None = typer.Option(None, "--nproc", help="Trainer ranks (sets launch.nproc)."),
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft or rl."),
    resume: str | None = RESUME,
) -> None:
    """Run `vlrl sft|rl` on launch.nproc Ray actors in a placement group (torch.distributed rendezvous wired), with
    launch.rollout_servers `vlrl serve` actors beside them."""
    from vlrl.launch.launcher import LaunchError, LaunchRefused, detect, prepare
    from vlrl.launch.launcher import launch as run_launch

    extra = [*([f"launch.nproc={nproc}"] if nproc else []), *([f"checkpoint.resume={resume}"] if resume else [])]
    try:
        # servers the launch starts stand in for rollout.servers.urls while the config is checked (their URLs come later)
        ready = prepare(detect(config, recipe), config, [*(overrides or []), *extra])  # before Ray starts
    except ConfigError as err:
        typer.secho(str(err), fg="red", err=True)
        raise typer.Exit(2) from None
    except LaunchRefused as err:
        typer.secho(f"vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    try:
        run_launch(ready.spec, ready.cfg.launch, address=ray_address, servers=ready.servers)
    except LaunchError as err:
        typer.secho(f"vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.secho("vlrl launch: interrupted; every rank and rollout server was stopped", fg="red", err=True)
        raise typer.Exit(130) from None


@app.command()
def plan(
    config: Path = typer.Argument(..., help="The YAML config of the run (sft or rl)."),
    overrides: list[str] | None = OVERRIDES,
    gpus: int = typer.Option(8, "--gpus", help="Devices to place the run on."),
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", help="Memory per device, GiB (an \"80GB\" A100 holds 80 GiB)."),
    tflops: float = typer.Option(312.0, "--tflops", help="Peak dense TFLOP/s per device in the compute dtype (A100: 312)."),
    bandwidth: float = typer.Option(2039.0, "--bandwidth", help="Device memory bandwidth, GB/s (A100-80GB: 2039)."),
    link: float = typer.Option(300.0, "--link", help="Bandwidth between devices, GB/s (NVLink ~300, across machines ~25)."),
    mfu: float = typer.Option(0.4, "--mfu", help="Assumed model-FLOPs utilisation of training and prefill."),
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft or rl."),
    measure: bool = typer.Option(False, "--measure", help="Also run one training step on this machine's CPU and "
                                 "print its measured peak memory beside the estimate (for small models)."),
    apply: Path | None = typer.Option(None, "--apply", help="Write the config with the chosen placement's launch "
                                      "settings in it to this YAML file (`vlrl launch --ray … FILE` starts it)."),
    pick: int | None = typer.Option(None, "--pick", min=1, help="With --apply: the placement ranked #N (default: #1)."),
) -> None:
    """Estimate per-device memory and step time of every placement (colocated/separate, FSDP/DDP); rank the feasible
    ones, each with the `vlrl launch` command that starts it."""
    from vlrl.check import model_path_problem
    from vlrl.launch import planner

    recipe = recipe_of(config, recipe)
    if recipe not in ("sft", "rl"):
        typer.secho(f"vlrl plan: plans sft and rl runs (got recipe {recipe!r}; pass --recipe)", fg="red", err=True)
        raise typer.Exit(2)
    cfg = load_run(RECIPES[recipe], config, overrides, [])
    try:
        problem = model_path_problem(cfg.model.path)
        if problem and not planner.is_config_only(cfg.model.path):  # a bare config.json plans too
            raise FileNotFoundError(problem)
        if measure and planner.is_config_only(cfg.model.path):
            raise ValueError("--measure runs a training step on this CPU: it needs the model's tokenizer and weights, "
                             "not a config.json alone")
        model, adapter = planner.meta_model(cfg.model.path, init_seed=cfg.model.init_seed)
    except (OSError, ValueError) as err:  # a missing directory, no hub, an unsupported family
        typer.secho(f"vlrl plan: model.path: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    from vlrl.data import DataError

    try:
        shape, work = planner.model_shape(model), planner.workload(cfg, adapter, model=model)
    except DataError as err:  # the prompts' sizes come from a few samples of data.train (a hub id may be unreachable)
        typer.secho(f"vlrl plan: data.train: {err} — plan with a local sample of the data (data.train=FILE) or the "
                    "procedural prompts (data.train=null)", fg="red", err=True)
        raise typer.Exit(2) from None
    device = planner.Device(gpus, gpu_mem, tflops=tflops, bandwidth_gbs=bandwidth, link_gbs=link, mfu=mfu)
    plans = planner.plan_placements(shape, work, device)
    launches = {p.name: planner.launch_settings(p, cfg, recipe, config, list(overrides or []))
                for p in planner.ranked(plans, device)}
    feasible = planner.ranked(plans, device, launches)  # what `#N` numbers: fits, and vlrl launch accepts it
    typer.echo(planner.format_plans(plans, device, work, shape, launches))
    if apply is not None:
        _apply_plan(apply, pick, feasible, launches, recipe, config, list(overrides or []))
    if measure:
        from vlrl.models import load_policy
        from vlrl.models.policy import LoadOptions

        policy = load_policy(cfg.model.path, dtype=cfg.model.dtype, seed=cfg.model.init_seed,
                             options=LoadOptions.of(cfg.model))
        typer.echo("\n" + planner.format_measurement(planner.measure_train_step(cfg, policy, work), shape, work))


def _apply_plan(out: Path, pick: int | None, feasible: list, launches: dict, recipe: str, config: Path,
                overrides: list[str]) -> None:
    """`vlrl plan --apply OUT`: the run's config with placement #pick's (or the best launchable one's) settings."""
    from vlrl.launch import planner
    from vlrl.launch.launcher import LaunchRefused, prepare

    if not feasible:
        typer.secho("vlrl plan: --apply: no placement that fits can be launched (see ✗ above)", fg="red", err=True)
        raise typer.Exit(1)
    if pick is not None and pick > len(feasible):
        typer.secho(f"vlrl plan: --pick {pick}: {len(feasible)} placement(s) are ranked", fg="red", err=True)
        raise typer.Exit(2)
    rank = pick or 1
    plan, settings = feasible[rank - 1], launches[feasible[rank - 1].name]
    header = (f"vlrl plan --apply: placement #{rank} {plan.name} (~{planner.human_seconds(plan.step_seconds)}/step)\n"
              f"from {config}{' with ' + ' '.join(overrides) if overrides else ''}\n"
              f"start it: vlrl launch --ray local|ADDRESS {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(planner.applied_config(RECIPES[recipe], config, [*overrides, *settings.overrides], header))
    try:
        prepare(recipe, out, [])  # what was written is what the launch accepts
    except (ConfigError, LaunchRefused) as err:
        typer.secho(f"vlrl plan: --apply: {out} is not accepted by vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"vlrl plan: wrote {out} (placement #{rank} {plan.name}: {' '.join(settings.overrides)}); "
               f"start it with: vlrl launch --ray local {out}")
