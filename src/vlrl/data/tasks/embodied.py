"""The `embodied` suite: one-shot household planning from a grid-world image (the embodied seed's task).

A kitchen is a 4×4 grid drawn with PIL: seven receptacles (table, counter, shelf, fridge, microwave,
cabinet, sink) in random cells, a few objects on the surfaces, and the robot's hand in the bottom-right
cell. With the default 112-pixel image a cell is 28×28 pixels — exactly one vision token of the tiny
Qwen2-VL presets (14-pixel patches, 2×2 merge). The fridge, microwave and cabinet are drawn filled
when closed and hollow (contents visible) when open, so the picture decides whether a plan must open them.

The model writes one JSON object (2505.22050 / the seed's prompt): ``visual_state_description``,
``reasoning_and_reflection``, ``language_plan`` and ``executable_plan`` — a list of steps
``{"action_id": 20, "action_name": "open the fridge"}`` over a fixed table of 30 actions (`ACTIONS`;
ids never change, the prompt lists the ones valid in the scene).

Tasks (ALFRED's analogues), by horizon:

- ``pick_place``: "put the apple on the table" — 4 steps, 6 when the destination is closed.
- ``clean``: wash it in the sink first — 9–11 steps.
- ``cool``: chill it in the fridge first (an object is cooled when the fridge is closed on it) — 9–13.
- ``heat``: heat it in the microwave first (the microwave is turned on with the door closed) — 11–15.
- ``pick_two``: put two objects in the same place — 8–12.

With probability ``history_prob`` an instance starts part-way: the prompt lists the steps already
executed (the seed's "action history"), the image shows the state after them, and the gold plan is the
rest (2505.22050's trajectory decomposition). The canonical (gold) plan leaves every door as it found
it; the executor (`World`) accepts any plan that reaches the goal with every step valid, so a plan can
succeed without equalling the gold plan (the seed's "functional equivalence").

Rewards (``reward`` option): the default ``{"plan_success": 0.8, "json_plan": 0.2}`` (execution success +
format); the seed's ``{"plan_prefix": 0.8, "json_plan": 0.2}`` (prefix reward R(n; k)) works the same
way; ``critic`` with `vlrl.rewards.plan.PLAN_JUDGE_TEMPLATE` asks a judge model (see the README).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw

from vlrl.data.sample import Sample
from vlrl.data.tasks import TASK_SUITES

OBJECTS = ("apple", "bread", "egg", "mug", "potato", "tomato")
SURFACES = ("table", "counter", "shelf")
OPENABLE = ("fridge", "microwave", "cabinet")
RECEPTACLES = SURFACES + OPENABLE + ("sink",)
TOGGLES = {"microwave": "microwave", "faucet": "sink"}  # switch → the receptacle the robot must be at
TASKS = ("pick_place", "clean", "cool", "heat", "pick_two")
HAND_CELL = 15  # the bottom-right cell of the 4×4 grid shows what the robot holds
MAX_PLAN_STEPS = 64  # the executor stops reading a plan after this many steps (bounded verifier cost)


def _action_table() -> tuple[str, ...]:
    names = [f"find a {thing}" for thing in OBJECTS + RECEPTACLES]
    names += [f"pick up the {o}" for o in OBJECTS]
    names += ["put down the object in hand"]
    names += [f"open the {r}" for r in OPENABLE] + [f"close the {r}" for r in OPENABLE]
    names += [f"turn on the {t}" for t in TOGGLES] + [f"turn off the {t}" for t in TOGGLES]
    return tuple(names)


ACTIONS: tuple[str, ...] = _action_table()  # action id → name; 30 actions, fixed
ACTION_IDS: dict[str, int] = {name: i for i, name in enumerate(ACTIONS)}
_VERBS = {"find a ": "find", "pick up the ": "pick up", "open the ": "open", "close the ": "close",
          "turn on the ": "turn on", "turn off the ": "turn off"}


def parse_action(action_id: int) -> tuple[str, str]:
    """``(verb, target)`` of an action id: ``("find", "apple")``, ``("put", "")``; KeyError if unknown."""
    if isinstance(action_id, bool) or not isinstance(action_id, int) or not 0 <= action_id < len(ACTIONS):
        raise KeyError(action_id)
    name = ACTIONS[action_id]
    if name == "put down the object in hand":
        return "put", ""
    for prefix, verb in _VERBS.items():
        if name.startswith(prefix):
            return verb, name[len(prefix):]
    raise KeyError(action_id)  # pragma: no cover - every table entry has a verb


# ----------------------------------------------------------------------------------------------- scene
@dataclass
class Scene:
    """One instance, JSON-serialisable (it travels in ``Sample.metadata["scene"]``).

    Attributes:
        task: one of `TASKS`.
        objects: object → the surface it starts on.
        targets: the object(s) the instruction names (two for ``pick_two``).
        destination: where they must end up.
        open: openable receptacle → open at the start.
        cells: receptacle → its grid cell (0..14).
    """

    task: str
    objects: dict[str, str]
    targets: list[str]
    destination: str
    open: dict[str, bool]
    cells: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "objects": dict(self.objects), "targets": list(self.targets),
                "destination": self.destination, "open": dict(self.open), "cells": dict(self.cells)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Scene:
        try:
            scene = cls(task=value["task"], objects=dict(value["objects"]), targets=list(value["targets"]),
                        destination=value["destination"], open={k: bool(v) for k, v in value["open"].items()},
                        cells={k: int(v) for k, v in value["cells"].items()})
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"embodied scene: missing or malformed field ({err!r}) in {value!r:.200}") from None
        if scene.task not in TASKS:
            raise ValueError(f"embodied scene: unknown task {scene.task!r}; tasks: {list(TASKS)}")
        return scene

    def valid_actions(self) -> dict[int, str]:
        """Ids and names of the actions that name something present in the scene (what the prompt lists)."""
        present = set(self.objects) | set(RECEPTACLES) | set(TOGGLES) | {""}
        return {i: name for i, name in enumerate(ACTIONS) if parse_action(i)[1] in present}

    def instruction(self) -> str:
        o, d = self.targets[0], self.destination
        where = f"in the {d}" if d in OPENABLE or d == "sink" else f"on the {d}"
        return {
            "pick_place": f"put the {o} {where}.",
            "clean": f"put a clean {o} {where}.",
            "cool": f"put a cold {o} {where}.",
            "heat": f"put a hot {o} {where}.",
            "pick_two": f"put the {o} and the {self.targets[-1]} {where}.",
        }[self.task]


# ----------------------------------------------------------------------------------------------- executor
@dataclass
class World:
    """The executor: the kitchen's state, changed one action at a time; `step` says why an action fails.

    Rules: ``find`` goes to an object (visible: not inside a closed receptacle) or a receptacle;
    ``pick up`` needs an empty hand and the robot at the object or its receptacle (open, if openable);
    ``put down`` needs a held object and the robot at an (open) receptacle; ``open``/``close`` need the
    robot at the receptacle and the door in the other state; the microwave runs only with its door closed
    and must be off to open; the faucet is at the sink. Effects: closing the fridge cools what is inside,
    turning the microwave on heats what is inside, turning the faucet on (or putting an object into the
    sink while it runs) cleans what is in the sink.
    """

    scene: Scene
    location: dict[str, str] = field(default_factory=dict)  # object → receptacle, or "hand"
    opened: dict[str, bool] = field(default_factory=dict)
    switched_on: dict[str, bool] = field(default_factory=dict)
    hot: set[str] = field(default_factory=set)
    cold: set[str] = field(default_factory=set)
    clean: set[str] = field(default_factory=set)
    at: str | None = None  # the receptacle (or object) the robot went to last
    holding: str | None = None

    @classmethod
    def start(cls, scene: Scene) -> World:
        return cls(scene, location=dict(scene.objects), opened=dict(scene.open),
                   switched_on={t: False for t in TOGGLES})

    def receptacle_of(self, thing: str | None) -> str | None:
        if thing in RECEPTACLES:
            return thing
        return self.location.get(thing) if thing is not None else None

    def step(self, action_id: Any) -> str | None:
        """Apply one action; returns None on success, else why it is invalid (the state is unchanged)."""
        try:
            verb, target = parse_action(action_id)
        except KeyError:
            return f"unknown action id {action_id!r}"
        here = self.receptacle_of(self.at)
        if verb == "find":
            if target in RECEPTACLES:
                self.at = target
                return None
            if target not in self.location:
                return f"there is no {target} here"
            if self.location[target] == "hand":
                return f"the {target} is already in hand"
            if not self.opened.get(self.location[target], True):
                return f"the {target} is not visible (inside the closed {self.location[target]})"
            self.at = target
            return None
        if verb == "pick up":
            if target not in self.location:
                return f"there is no {target} here"
            if self.holding is not None:
                return f"the hand already holds the {self.holding}"
            source = self.location[target]
            if here != source:
                return f"the robot is not at the {target}"
            if not self.opened.get(source, True):
                return f"the {source} is closed"
            self.location[target], self.holding, self.at = "hand", target, source
            return None
        if verb == "put":
            if self.holding is None:
                return "the hand is empty"
            if here is None:
                return "the robot is not at a receptacle"
            if not self.opened.get(here, True):
                return f"the {here} is closed"
            self.location[self.holding], self.holding, self.at = here, None, here
            self._effects()
            return None
        if verb in ("open", "close"):
            if here != target:
                return f"the robot is not at the {target}"
            want = verb == "open"
            if self.opened[target] == want:
                return f"the {target} is already {'open' if want else 'closed'}"
            if want and target == "microwave" and self.switched_on["microwave"]:
                return "turn off the microwave before opening it"
            self.opened[target] = want
            if not want and target == "fridge":
                self.cold.update(o for o, r in self.location.items() if r == "fridge")
            return None
        # turn on / turn off
        if here != TOGGLES[target]:
            return f"the robot is not at the {TOGGLES[target]}"
        want = verb == "turn on"
        if self.switched_on[target] == want:
            return f"the {target} is already {'on' if want else 'off'}"
        if want and target == "microwave" and self.opened["microwave"]:
            return "close the microwave before turning it on"
        self.switched_on[target] = want
        self._effects()
        return None

    def _effects(self) -> None:
        for obj, where in self.location.items():
            if where == "microwave" and self.switched_on["microwave"]:
                self.hot.add(obj)
            if where == "sink" and self.switched_on["faucet"]:
                self.clean.add(obj)

    def goal_reached(self) -> bool:
        scene = self.scene
        placed = all(self.location.get(o) == scene.destination for o in scene.targets)
        state = {"heat": self.hot, "cool": self.cold, "clean": self.clean}.get(scene.task)
        return placed and (state is None or all(o in state for o in scene.targets))


@dataclass
class Execution:
    """The outcome of executing a plan: ``valid_steps`` ran before ``error`` at step ``first_error``."""

    success: bool
    valid_steps: int
    steps: int
    first_error: int | None = None
    error: str = ""


def execute_plan(scene: Scene | Mapping[str, Any], plan: Iterable[Any], *, history: Sequence[int] = ()) -> Execution:
    """Run ``history`` (must be valid), then ``plan`` (action ids) from the scene's start; stop at the first
    invalid step. Success = every step valid and the goal holds at the end. At most `MAX_PLAN_STEPS` are read."""
    scene = scene if isinstance(scene, Scene) else Scene.from_json(scene)
    world = World.start(scene)
    for k, action_id in enumerate(history):
        error = world.step(action_id)
        if error:
            raise ValueError(f"embodied history step {k} ({action_id!r}) is invalid: {error}")
    plan = list(plan)[: MAX_PLAN_STEPS + 1]
    for k, action_id in enumerate(plan):
        if k == MAX_PLAN_STEPS:
            return Execution(False, k, len(plan), k, f"plan longer than {MAX_PLAN_STEPS} steps")
        error = world.step(action_id)
        if error:
            return Execution(False, k, len(plan), k, error)
    return Execution(world.goal_reached(), len(plan), len(plan), None, "" if world.goal_reached() else "goal not reached")


# ----------------------------------------------------------------------------------------------- gold plan
def gold_plan(scene: Scene) -> list[int]:
    """The canonical plan (action ids): fetch, treat (clean/cool/heat), place; every door is left as found."""
    a = ACTION_IDS
    plan: list[int] = []

    def use(receptacle: str, inner: list[str]) -> None:
        """Go to ``receptacle``, open it if closed, do ``inner``, close it again if it was closed."""
        plan.append(a[f"find a {receptacle}"])
        closed = receptacle in OPENABLE and not scene.open[receptacle]
        if closed:
            plan.append(a[f"open the {receptacle}"])
        plan.extend(a[name] for name in inner)
        if closed:
            plan.append(a[f"close the {receptacle}"])

    def fetch(obj: str) -> None:
        plan.extend([a[f"find a {obj}"], a[f"pick up the {obj}"]])

    obj = scene.targets[0]
    put = "put down the object in hand"
    fetch(obj)
    if scene.task == "clean":
        use("sink", [put, "turn on the faucet", "turn off the faucet", f"pick up the {obj}"])
    elif scene.task == "cool":  # the fridge cools on closing: close, reopen, take out
        plan.append(a["find a fridge"])
        if not scene.open["fridge"]:
            plan.append(a["open the fridge"])
        plan.extend([a[put], a["close the fridge"], a["open the fridge"], a[f"pick up the {obj}"]])
        if not scene.open["fridge"]:
            plan.append(a["close the fridge"])
    elif scene.task == "heat":  # the microwave runs closed: close it if it was open, reopen to take out
        plan.append(a["find a microwave"])
        if not scene.open["microwave"]:
            plan.append(a["open the microwave"])
        plan.extend(a[n] for n in (put, "close the microwave", "turn on the microwave", "turn off the microwave",
                                   "open the microwave", f"pick up the {obj}"))
        if not scene.open["microwave"]:
            plan.append(a["close the microwave"])
    use(scene.destination, [put])
    if scene.task == "pick_two":
        fetch(scene.targets[1])
        use(scene.destination, [put])
    return plan


# ----------------------------------------------------------------------------------------------- drawing
RECEPTACLE_COLORS = {"table": (150, 100, 50), "counter": (128, 128, 128), "shelf": (205, 170, 100),
                     "fridge": (50, 120, 220), "microwave": (40, 40, 40), "cabinet": (160, 60, 160),
                     "sink": (60, 200, 200)}
OBJECT_STYLE = {"apple": ((220, 30, 30), "circle"), "bread": ((240, 140, 20), "square"),
                "egg": ((245, 235, 120), "circle"), "mug": ((30, 160, 60), "square"),
                "potato": ((120, 80, 40), "triangle"), "tomato": ((250, 110, 170), "triangle")}


def draw_state(world: World, size: int = 112) -> Image.Image:
    """The kitchen as the robot sees it: receptacles filling their cells (the fridge, microwave and cabinet
    filled with a white handle when closed, hollow when open), the visible objects (up to four per cell), a
    small orange light on a running microwave / faucet, the held object in the outlined hand cell
    (bottom right), and a black marker in the corner of the cell where the robot stands."""
    cell = size // 4
    unit = cell / 28  # drawing sizes below are for 28-pixel cells
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)

    def origin(index: int) -> tuple[int, int]:
        return (index % 4) * cell, (index // 4) * cell

    def at(x: int, y: int, a: float, b: float, c: float, d: float) -> list[int]:
        return [round(x + a * unit), round(y + b * unit), round(x + c * unit), round(y + d * unit)]

    for receptacle, index in world.scene.cells.items():
        x, y = origin(index)
        color = RECEPTACLE_COLORS[receptacle]
        if receptacle in OPENABLE and world.opened[receptacle]:
            draw.rectangle(at(x, y, 1, 1, 26, 26), outline=color, width=max(1, round(3 * unit)))
        else:
            draw.rectangle(at(x, y, 1, 1, 26, 26), fill=color)
            if receptacle in OPENABLE:
                draw.rectangle(at(x, y, 22, 8, 24, 19), fill=(255, 255, 255))  # the door handle
        switch = {"microwave": "microwave", "sink": "faucet"}.get(receptacle)
        if switch and world.switched_on[switch]:
            draw.ellipse(at(x, y, 1, 1, 6, 6), fill=(255, 140, 0))
    hx, hy = origin(HAND_CELL)
    draw.rectangle(at(hx, hy, 1, 1, 26, 26), outline=(0, 0, 0), width=1)
    shown: dict[int, int] = {}
    for obj, where in sorted(world.location.items()):
        if where == "hand":
            index = HAND_CELL
        elif world.opened.get(where, True):
            index = world.scene.cells[where]
        else:
            continue  # inside a closed receptacle: not visible
        slot = shown.get(index, 0)
        shown[index] = slot + 1
        x, y = origin(index)
        dx, dy = 6 + 9 * (slot % 2), 6 + 9 * (slot // 2)
        _draw_object(draw, obj, at(x, y, dx, dy, dx + 7, dy + 7))
    here = world.receptacle_of(world.at)
    if here is not None:
        x, y = origin(world.scene.cells[here])
        draw.rectangle(at(x, y, 23, 23, 26, 26), fill=(0, 0, 0))
    return image


def _draw_object(draw: ImageDraw.ImageDraw, obj: str, bbox: list[int]) -> None:
    color, shape = OBJECT_STYLE[obj]
    x1, y1, x2, y2 = bbox
    if shape == "circle":
        draw.ellipse(bbox, fill=color, outline=(0, 0, 0))
    elif shape == "square":
        draw.rectangle(bbox, fill=color, outline=(0, 0, 0))
    else:
        draw.polygon([((x1 + x2) / 2, y1), (x1, y2), (x2, y2)], fill=color, outline=(0, 0, 0))


# ----------------------------------------------------------------------------------------------- text
def describe(world: World) -> str:
    """The visual state description of the gold response: doors and hand."""
    doors = ", ".join(f"{r} {'open' if world.opened[r] else 'closed'}" for r in OPENABLE)
    hand = f"holding the {world.holding}" if world.holding else "hand empty"
    return f"{doors}; {hand}"


def language_plan(scene: Scene) -> str:
    o, d = scene.targets[0], scene.destination
    treat = {"clean": f"wash the {o} in the sink, ", "cool": f"chill the {o} in the fridge, ",
             "heat": f"heat the {o} in the microwave, "}.get(scene.task, "")
    if scene.task == "pick_two":
        return f"take the {o} to the {d}, then the {scene.targets[1]}"
    return f"take the {o}, {treat}put it in the {d}" if d in OPENABLE else f"take the {o}, {treat}put it on the {d}"


def reasoning(scene: Scene, world: World) -> str:
    needs = [r for r in OPENABLE if not world.opened[r] and _uses(scene, r)]
    doors = f"open the {' and '.join(needs)} first" if needs else "no door to open"
    return f"{doors}; leave doors as found"


def _uses(scene: Scene, receptacle: str) -> bool:
    return receptacle == scene.destination or {"cool": "fridge", "heat": "microwave"}.get(scene.task) == receptacle


def plan_json(action_ids: Iterable[int]) -> list[dict[str, Any]]:
    return [{"action_id": i, "action_name": ACTIONS[i]} for i in action_ids]


def gold_response(scene: Scene, world: World, remaining: Sequence[int]) -> str:
    """The reference response SFT trains on: the seed's four fields, the plan as ``{action_id, action_name}``."""
    return json.dumps({
        "visual_state_description": describe(world),
        "reasoning_and_reflection": reasoning(scene, world),
        "language_plan": language_plan(scene),
        "executable_plan": plan_json(remaining),
    })


REFERENCE_TEMPLATE = "Here is a reference successful plan: {reference}"


def with_reference(messages: list[dict[str, Any]], answer: Any, template: str = REFERENCE_TEMPLATE) -> list[dict[str, Any]]:
    """``messages`` with the reference plan appended to the last user message — the privileged context of the
    forward-proxy teacher (the seed's "Here is a reference successful language plan: ..."). ``answer`` is the
    gold plan, shown as JSON; the input is not modified."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            note = "\n" + template.format(reference=json.dumps(answer))
            content = message.get("content")
            message["content"] = (content + note if isinstance(content, str)
                                  else [*content, {"type": "text", "text": note}])
            return out
    raise ValueError("with_reference: the messages hold no user message to add the reference plan to")


PROMPT_TAIL = ("Output ONLY a JSON object with visual_state_description, reasoning_and_reflection, language_plan "
               "and executable_plan (a list of {action_id, action_name}).")


def prompt_text(scene: Scene, history: Sequence[int], *, list_actions: bool = True) -> str:
    lines = [f"You are a household robot. Instruction: {scene.instruction()}",
             "History: " + ("; ".join(ACTIONS[i] for i in history) if history else "none")]
    if list_actions:
        lines.append("Actions: " + ", ".join(f"{i} {name}" for i, name in scene.valid_actions().items()))
    lines.append(PROMPT_TAIL)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the suite
def random_scene(rng: random.Random, task: str, *, max_distractors: int = 1, open_prob: float = 0.5) -> Scene:
    """A random instance of ``task``: targets and distractors on random surfaces, random doors and cells."""
    n_targets = 2 if task == "pick_two" else 1
    names = rng.sample(OBJECTS, n_targets + rng.randint(0, max_distractors))
    targets = names[:n_targets]
    excluded = {"clean": "sink", "cool": "fridge", "heat": "microwave"}.get(task)
    destinations = [r for r in RECEPTACLES if r not in (excluded, "sink", "microwave")]
    objects = {o: rng.choice(SURFACES) for o in names}
    destination = rng.choice([r for r in destinations if r not in {objects[t] for t in targets}])
    cells = dict(zip(RECEPTACLES, rng.sample(range(HAND_CELL), len(RECEPTACLES)), strict=True))
    return Scene(task=task, objects=objects, targets=targets, destination=destination,
                 open={r: rng.random() < open_prob for r in OPENABLE}, cells=cells)


def instance(rng: random.Random, task: str, *, max_distractors: int = 1, open_prob: float = 0.5,
             history_prob: float = 0.3) -> tuple[Scene, World, list[int], list[int]]:
    """A scene, the world after its history, the history and the remaining gold plan."""
    scene = random_scene(rng, task, max_distractors=max_distractors, open_prob=open_prob)
    plan = gold_plan(scene)
    cut = rng.randint(1, len(plan) - 1) if rng.random() < history_prob else 0
    world = World.start(scene)
    for action_id in plan[:cut]:
        world.step(action_id)
    return scene, world, plan[:cut], plan[cut:]


def text_corpus(n: int, *, seed: int = 0) -> list[str]:
    """Prompts and gold responses of ``n`` instances over all tasks, without images (the preset tokenizers'
    training text)."""
    out = []
    for i in range(n):
        rng = random.Random(f"embodied/tokenizer/{seed}/{i}")
        scene, world, history, remaining = instance(rng, TASKS[i % len(TASKS)])
        out += [prompt_text(scene, history), gold_response(scene, world, remaining),
                REFERENCE_TEMPLATE.format(reference=json.dumps(plan_json(remaining)))]
    return out


@TASK_SUITES.register("embodied")
def generate_embodied(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    tasks: list[str] | None = None,
    image_size: int = 112,
    max_distractors: int = 1,
    open_prob: float = 0.5,
    history_prob: float = 0.3,
    list_actions: bool = True,
    reference_prob: float = 0.0,
    reward: str | dict[str, float] | None = None,
) -> list[Sample]:
    """Generate ``n`` embodied planning samples, cycling through ``tasks`` (default: all of `TASKS`).

    Args:
        image_size: side of the square image (a multiple of 4; 112 → one vision token per cell).
        max_distractors: objects besides the targets, 0..max_distractors per scene.
        open_prob: probability that each of fridge, microwave, cabinet starts open.
        history_prob: probability that an instance starts part-way (executed steps listed as history).
        list_actions: list the scene's valid ``id name`` actions in the prompt.
        reference_prob: probability that the prompt also shows the gold plan (`with_reference`): SFT on such
            samples teaches a model to use a reference, so that it can serve as the forward-proxy teacher.
            Never applied to the ``test`` split (held-out prompts stay plain).
        reward: verifier weights; default ``{"plan_success": 0.8, "json_plan": 0.2}``.

    ``answer`` is the gold remaining plan (``[{action_id, action_name}]``); ``metadata`` holds ``scene``,
    ``history`` (executed action ids), ``actions`` (the valid id → name table, checked by ``json_plan``)
    and ``gold_steps``.
    """
    tasks = list(tasks or TASKS)
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"embodied: unknown task(s) {unknown}; choose from {list(TASKS)}")
    if image_size % 4 or image_size < 56:
        raise ValueError(f"embodied: image_size must be a multiple of 4 and ≥ 56, got {image_size}")
    if not 0 <= max_distractors <= 2:
        raise ValueError(f"embodied: max_distractors must be in 0..2 (at most four objects), got {max_distractors}")
    for name, p in (("open_prob", open_prob), ("history_prob", history_prob), ("reference_prob", reference_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"embodied: {name} must be in [0, 1], got {p}")
    weights = reward if reward is not None else {"plan_success": 0.8, "json_plan": 0.2}
    samples = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        rng = random.Random(f"embodied/{split}/{seed}/{i}")
        scene, world, history, remaining = instance(rng, task, max_distractors=max_distractors, open_prob=open_prob,
                                                    history_prob=history_prob)
        messages = [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": prompt_text(scene, history, list_actions=list_actions)}]}]
        if rng.random() < reference_prob and split != "test":
            messages = with_reference(messages, plan_json(remaining))
        samples.append(Sample(
            id=f"embodied-{split}-{seed}-{i:06d}",
            task=f"embodied/{task}",
            messages=messages,
            images=[draw_state(world, image_size)],
            answer=plan_json(remaining),
            reward=weights,
            response=gold_response(scene, world, remaining),
            metadata={"scene": scene.to_json(), "history": history, "actions": scene.valid_actions(),
                      "gold_steps": len(remaining)},
        ))
    return samples
