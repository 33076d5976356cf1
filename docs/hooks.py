"""The generated parts of the docs site, written from the code at build time (never by hand).

`mkdocs build` loads this file as a hook (``hooks:`` in mkdocs.yml). A page that holds a marker line
``<!-- generated: NAME -->`` gets that marker replaced by the markdown of `GENERATORS[NAME]`:

- ``config``: every field of `vlrl.config`'s `SFTConfig`, `RLConfig` and `DemoConfig` — one table per section
  class, its docstring, and per field the type, the default, the bounds and the pydantic ``description``;
- ``cli``: every command of the `vlrl` typer app, its usage, help and options (read from click's objects);
- ``registries``: every `vlrl.registry.Registry` defined in a module of vlrl, its signature and its entries;
- ``presets``: the tiny offline model presets, by the family module that declares each (`vlrl.models.families`);
- ``metrics``: every metric name written literally in vlrl's source (``"policy/entropy"``, ``f"reward/{task}"``),
  by group, with the modules that write it;
- ``rollout_moves``: the flat ``rollout.*`` keys that moved into the rollout sub-sections, old → new
  (`vlrl.config.MOVED_KEYS`, the table the config's own error messages come from);
- ``gpu_plan``: `vlrl plan`'s per-phase memory of the GPU check's update arms (`benchmarks/gpu_check.py`);
- ``memory_plan``: `vlrl plan`'s memory for the memory guide's real case (Qwen2.5-VL-7B on one 80 GiB device, four
  arms: `MEMORY_PLAN_ARMS`).

Run as a script to print one of them: ``python docs/hooks.py config`` (with vlrl importable).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: ([a-z_]+) -->$", re.M)


# ------------------------------------------------------------------------------------------------ helpers
def _cell(text: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    """``int | None``, ``'sync' | 'async'``, ``list[str]``, ``SectionName`` — short and readable."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _sections(annotation: Any) -> list[type]:
    """The pydantic section classes inside an annotation (``X``, ``X | None``, ``list[X]``)."""
    from pydantic import BaseModel

    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [c for a in typing.get_args(annotation) for c in _sections(a)]


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if hasattr(value, "model_dump"):
        return "(section defaults)"
    return _code(repr(value) if isinstance(value, str) else value)


def _bounds(field: Any) -> str:
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for meta in field.metadata:
        for attr, sign in marks.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return ", ".join(out)


# ------------------------------------------------------------------------------------------------ config
def config_reference() -> str:
    """One table per section class of the three run configs, in the order a reader meets them."""
    from vlrl.config import DemoConfig, RLConfig, SFTConfig

    roots = [("vlrl sft", SFTConfig), ("vlrl rl", RLConfig), ("vlrl demo", DemoConfig)]
    where: dict[type, list[str]] = {}  # section class → the paths it sits at, e.g. "vlrl rl: rollout"
    order: list[type] = []

    def visit(cls: type, path: str, command: str, depth: int) -> None:
        if depth > 6:
            return
        if cls not in where:
            where[cls] = []
            order.append(cls)
        label = f"{command}: {path}" if path else command
        if label not in where[cls]:
            where[cls].append(label)
        for name, field in cls.model_fields.items():
            for sub in _sections(field.annotation):
                is_list = typing.get_origin(field.annotation) is list or any(
                    typing.get_origin(a) is list for a in typing.get_args(field.annotation))
                visit(sub, f"{path}.{name}{'[]' if is_list else ''}".lstrip("."), command, depth + 1)

    for command, cls in roots:
        visit(cls, "", command, 0)

    lines = [f"{len(order)} section classes, {sum(len(c.model_fields) for c in order)} fields "
             "(a field of a section used in several places is listed once, under its section).", ""]
    for cls in order:
        lines += [f"### {cls.__name__}", ""]
        doc = inspect.getdoc(cls)
        if doc and cls.__doc__ is not None and "__doc__" in cls.__dict__:
            lines += [doc, ""]
        lines += ["Used at: " + ", ".join(_code(w) for w in where[cls]), ""]
        lines += ["| field | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            subs = _sections(field.annotation)
            kind = _cell(_type_name(field.annotation))
            if len(subs) == 1:
                kind = f"[{kind}](#{subs[0].__name__.lower()})"
            lines.append(f"| {_code(name)} | {kind} | {_default(field)} | "
                         f"{_cell(_bounds(field))} | {_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def rollout_moves() -> str:
    """The old flat ``rollout.*`` keys → their places in the sub-sections, from `vlrl.config.MOVED_KEYS`."""
    from vlrl.config import MOVED_KEYS

    lines = ["| old key | new key |", "| --- | --- |"]
    lines += [f"| {_code('rollout.' + old)} | {_code('rollout.' + new)} |" for old, new in MOVED_KEYS.items()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ cli
def _param_type(param: Any) -> str:
    descriptor = getattr(param, "type_descriptor", None)  # typer ≥ 0.2x (its own copy of click)
    if descriptor is not None and getattr(descriptor, "annotation", None) is not None:
        return _type_name(descriptor.annotation)
    kind = getattr(param, "type", None)  # click
    return getattr(kind, "name", "") if kind is not None else ""


def cli_reference() -> str:
    """Every command of the `vlrl` app, as typer builds it (click's object model: groups, commands, params)."""
    import typer

    from vlrl.cli import app

    root = typer.main.get_command(app)
    lines: list[str] = []

    def walk(cmd: Any, names: list[str], parent: Any) -> None:
        ctx = cmd.context_class(cmd, info_name=names[-1], parent=parent)
        if hasattr(cmd, "list_commands"):  # a group: its own options (`vlrl --version`), then its commands
            if parent is None and cmd.params:
                lines.extend([f"### {names[0]}", "", *([inspect.cleandoc(cmd.help), ""] if cmd.help else []),
                              "| option | help |", "| --- | --- |"])
                lines.extend(f"| {_code(', '.join(p.opts))} | {_cell(getattr(p, 'help', None) or '')} |"
                             for p in cmd.params if not getattr(p, "hidden", False))
                lines.append("")
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*names, name], ctx)
            return
        lines.extend([f"### {' '.join(names)}", "", "```text", cmd.get_usage(ctx).replace("Usage: ", ""), "```", ""])
        if cmd.help:
            lines.extend([inspect.cleandoc(cmd.help), ""])
        rows = []
        for param in cmd.params:
            if getattr(param, "hidden", False):
                continue
            argument = getattr(param, "param_type_name", "") == "argument"
            name = param.name.upper() if argument else ", ".join([*param.opts, *param.secondary_opts])
            default = param.default
            shown = "" if callable(default) or default is None or default == () or default == [] else _code(default)
            rows.append(f"| {_code(name)} | {_cell(_param_type(param))} | {shown} | "
                        f"{_cell(getattr(param, 'help', None) or '')} |")
        if rows:
            lines.extend(["| argument / option | type | default | help |", "| --- | --- | --- | --- |", *rows, ""])

    walk(root, ["vlrl"], None)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ registries
def _import_all() -> tuple[list[types.ModuleType], list[str]]:
    import vlrl

    modules, failed = [vlrl], []
    for info in pkgutil.walk_packages(vlrl.__path__, "vlrl."):
        try:
            modules.append(importlib.import_module(info.name))
        except Exception as err:  # an optional dependency missing: named on the page
            failed.append(f"{info.name} ({type(err).__name__}: {err})")
    return modules, failed


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _options(obj: Any) -> str:
    model = getattr(obj, "options_model", None)
    if model is not None:
        return ", ".join(model.model_fields)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    return ", ".join(p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY)


def registries_reference() -> str:
    from vlrl.registry import Registry

    modules, failed = _import_all()
    found: dict[int, tuple[str, Registry]] = {}  # the module that assigns it (others re-export it)
    for module in modules:
        for attr, value in vars(module).items():
            if not isinstance(value, Registry):
                continue
            try:
                assigns = re.search(rf"^{attr}\b[^=\n]*=\s*Registry\(", inspect.getsource(module), re.M)
            except (OSError, TypeError):
                assigns = None
            if assigns or id(value) not in found:
                found[id(value)] = (f"{module.__name__}.{attr}", value)
    lines = [f"{len(found)} registries. A config field that takes a registered name also takes a dotted path "
             "`pkg.mod:fn` to your own callable with the same signature.", ""]
    for where, registry in sorted(found.values(), key=lambda item: item[1].kind):
        lines += [f"### {registry.kind}", "", f"Registry {_code(where)}; signature {_code(registry.signature)}.", ""]
        lines += ["| name | implemented by | options | summary |", "| --- | --- | --- | --- |"]
        for name, entry in registry.items():
            target = f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__name__)}"
            lines.append(f"| {_code(name)} | {_code(target)} | {_cell(_options(entry))} | {_cell(_first_line(entry))} |")
        lines.append("")
    if failed:
        lines += ["Modules that could not be imported where this page was built (their registries are missing "
                  "above): " + "; ".join(_code(f) for f in failed), ""]
    return "\n".join(lines)


def presets_reference() -> str:
    """The tiny presets, by the family module that declares each (`vlrl.models.families`)."""
    from vlrl.models.families import all_families

    lines = ["| `model.path` | family (`model_type`) | declared in | vision tower | tokenizer eos / pad |",
             "| --- | --- | --- | --- | --- |"]
    for family in all_families():
        for name, spec in family.presets.items():
            module = inspect.getmodule(spec.build)
            lines.append(f"| {_code(name)} | {_code(spec.family)} | {_code(module.__name__ if module else '?')} | "
                         f"{_code(family.vision_tower) if family.vision_tower else '(text only)'} | "
                         f"{_code(spec.markup.eos)} / {_code(spec.markup.pad)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ metrics
GROUPS = ("reward", "accuracy", "policy", "response", "rollout", "perf", "data", "agent", "staleness", "sampling",
          "critic", "shaping", "synth", "diversity", "dist", "train", "sft", "val", "eval")
_NAME = re.compile(rf"^({'|'.join(GROUPS)})/[A-Za-z0-9_@=<>./-]*$")


def _fstring(node: ast.JoinedStr) -> str:
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        else:
            expr = ast.unparse(value.value)  # type: ignore[attr-defined]
            parts.append(f"<{expr.split('.')[-1]}>")
    return "".join(parts)


def metric_names(src: Path | None = None) -> dict[str, set[str]]:
    """Metric name → the modules (dotted) whose source spells it (the loggers, and the report that plots it)."""
    import vlrl

    src = src or Path(vlrl.__file__).parent
    names: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        module = ".".join(("vlrl", *path.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        fstring_parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = _fstring(node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in fstring_parts:
                text = node.value
            else:
                continue
            if _NAME.match(text) and not text.endswith("/") and "<>" not in text:
                names.setdefault(text, set()).add(module)
    return names


def metrics_reference() -> str:
    names = metric_names()
    lines = [f"{len(names)} names in {len({n.split('/')[0] for n in names})} groups. `<x>` is filled in at run time "
             "(a task, a shaper's name, a key of a stats record).", ""]
    for group in GROUPS:
        rows = sorted(n for n in names if n.split("/")[0] == group)
        if not rows:
            continue
        lines += [f"### {group}/", "", "| name | named in |", "| --- | --- |"]
        lines += [f"| {_code(n)} | {', '.join(_code(m) for m in sorted(names[n]))} |" for n in rows]
        lines.append("")
    return "\n".join(lines)


def gpu_plan() -> str:
    """`vlrl plan`'s per-phase figures for the GPU check's update arms (`benchmarks/gpu_check.py`'s `plan_markdown`,
    the estimate the check compares its measurements with)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.plan_markdown()


# The memory guide's real case: Qwen2.5-VL-7B (its published config.json, tests/fixtures/model_configs/) on one 80 GiB
# device, 16 prompts × 8 responses of up to 1,024 tokens, micro-batches of 16 — the overrides its `vlrl plan` command
# gives — and the arms (label, shipped config, overrides of the arm).
MEMORY_PLAN_OVERRIDES = ("model.path=tests/fixtures/model_configs/qwen2_5_vl_7b.json", "model.dtype=bfloat16",
                         "rollout.max_new_tokens=1024", "rollout.engine.max_batch_size=16", "train.micro_batch_size=16")
MEMORY_PLAN_ARMS = (
    ("full fine-tune, fp32, checkpointing (`shapes_grpo.yaml`)", "shapes_grpo.yaml", ("model.dtype=float32",)),
    ("full fine-tune, bf16, checkpointing", "shapes_grpo.yaml", ()),
    ("LoRA r=16 (Ψ_lora = {lora}), bf16, no checkpointing", "shapes_lora_grpo.yaml",
     ("train.gradient_checkpointing=false",)),
    ("**LoRA r=16, bf16, checkpointing** (`shapes_lora_grpo.yaml`)", "shapes_lora_grpo.yaml", ()),
)


def memory_plan() -> str:
    """`vlrl plan`'s memory per phase for the memory guide's real case (`MEMORY_PLAN_ARMS`): the placement
    "colocated fsdp×1" on ``--gpus 1 --gpu-mem 80`` at the planner's default device figures, per arm the resident
    state, the forward + backward phase's terms, the optimizer step's temporaries and the step's peak."""
    from vlrl.config import RLConfig, load_config
    from vlrl.launch import planner
    from vlrl.launch.memory import count_text

    gib = 2**30
    device = planner.Device(1, 80)
    lines = ["| run (`vlrl plan`, 1 × 80 GiB) | params | grads | AdamW | activations (text + vision) | logits | "
             "forward + backward | AdamW temporaries | peak (phase) | fits |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    meta: dict[str, Any] = {}
    for label, config, extra in MEMORY_PLAN_ARMS:
        cfg = load_config(RLConfig, ROOT / "configs" / config,
                          [o.replace("model.path=", f"model.path={ROOT}/") for o in (*MEMORY_PLAN_OVERRIDES, *extra)])
        if cfg.model.path not in meta:
            model, adapter = planner.meta_model(cfg.model.path)
            meta[cfg.model.path] = (model, adapter, planner.model_shape(model))
        model, adapter, shape = meta[cfg.model.path]
        work = planner.workload(cfg, adapter, model=model)
        plan = next(p for p in planner.plan_placements(shape, work, device) if p.name == "colocated fsdp×1")
        memory = plan.phases["all devices"]
        held = {t.name: t.value / gib for t in memory.resident}
        train = {t.name: t.value / gib for t in memory.phases["forward + backward"]}
        step = {t.name: t.value / gib for t in memory.phases["optimizer step"]}
        peak = memory.total(memory.peak_phase) / gib
        cells = [f"{held['actor parameters']:.2f} GiB", f"{train['actor gradients']:.2f} GiB",
                 f"{held['actor AdamW moments']:.2f} GiB",
                 f"{train['actor activations']:.2f} + {train['vision activations']:.2f} GiB",
                 f"{train['logits (fp32)']:.2f} GiB", f"{memory.total('forward + backward') / gib:.2f} GiB",
                 f"{step['AdamW step temporaries']:.2f} GiB"]
        bold = "**" if label.startswith("**") else ""
        fits = f"✓ ~{plan.step_seconds:.0f} s/step" if plan.feasible(device) else "✗"
        lines.append(f"| {label.format(lora=count_text(work.adapter_params))} | {' | '.join(cells)} | "
                     f"{bold}{peak:.2f} GiB{bold} ({memory.peak_phase}) | {fits} |")
        times = {t.name: t.value for t in plan.time}
    lines += ["", f"Step time of the last row at the defaults `--tflops {device.tflops:g} --mfu {device.mfu:g}`: "
              f"{times['decode']:.0f} s of decoding, {times['train']:.0f} s of training, "
              f"{times['scoring passes']:.0f} s of scoring (`vlrl plan`'s time terms)."]
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference, "cli": cli_reference, "registries": registries_reference,
    "presets": presets_reference, "metrics": metrics_reference, "rollout_moves": rollout_moves,
    "gpu_plan": gpu_plan, "memory_plan": memory_plan,
}
_CACHE: dict[str, str] = {}


def render(markdown: str) -> str:
    """``markdown`` with every marker line replaced by its generated text (an unknown marker raises)."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown generated section {name!r}; known: {sorted(GENERATORS)}")
        if name not in _CACHE:
            _CACHE[name] = GENERATORS[name]()
        return _CACHE[name]

    return MARKER.sub(replace, markdown)


# ------------------------------------------------------------------------------------------------ mkdocs hooks
def on_startup(command: str, dirty: bool) -> None:
    """Make the checkout's ``src`` importable first (the build may run outside an editable install)."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown)


if __name__ == "__main__":
    on_startup("", False)
    print(GENERATORS[sys.argv[1]]())
