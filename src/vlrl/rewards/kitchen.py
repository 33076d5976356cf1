"""The `embodied` suite's kitchen (`vlrl.data.tasks.embodied`) as rules: the fixed table of 30 actions, a
scene, the executor (`World`) and `execute_plan`, which the ``plan_success`` reward runs on a predicted plan.
Pure: no image, no model. The suite draws the kitchen and writes the prompts and gold plans; the reward room,
below it, needs only these rules, so they live here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OBJECTS = ("apple", "bread", "egg", "mug", "potato", "tomato")
SURFACES = ("table", "counter", "shelf")
OPENABLE = ("fridge", "microwave", "cabinet")
RECEPTACLES = SURFACES + OPENABLE + ("sink",)
TOGGLES = {"microwave": "microwave", "faucet": "sink"}  # switch → the receptacle the robot must be at
TASKS = ("pick_place", "clean", "cool", "heat", "pick_two")
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
