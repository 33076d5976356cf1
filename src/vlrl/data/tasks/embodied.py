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
from collections.abc import Iterable, Sequence
from typing import Any

from PIL import Image, ImageDraw

from vlrl.data.sample import Sample
from vlrl.data.tasks import TASK_SUITES
from vlrl.rewards.kitchen import (
    ACTION_IDS,
    ACTIONS,
    OBJECTS,
    OPENABLE,
    RECEPTACLES,
    SURFACES,
    TASKS,
    Scene,
    World,
)
from vlrl.rewards.kitchen import execute_plan as execute_plan  # re-exported: the suite's executor
from vlrl.rewards.kitchen import parse_action as parse_action  # re-exported

HAND_CELL = 15  # the bottom-right cell of the 4×4 grid shows what the robot holds


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
