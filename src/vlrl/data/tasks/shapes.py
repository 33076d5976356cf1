"""The `shapes` suite: simple coloured shapes drawn with PIL, four perception tasks.

- ``count``: "How many shapes are there?" (1..max_shapes) → a number, verified by ``number``.
- ``color``: "What color is the <shape>?" with lettered options → a letter, verified by ``multiple_choice``.
- ``locate``: "Where is the <shape>?" → a box ``[x1, y1, x2, y2]`` in pixels (or 0..1000 normalised, stated in
  the prompt), verified by ``bbox_iou``.
- ``ocr``: "What word is written in the image?" → a short word, verified by ``ocr``.
- ``video_count``: a clip of ``frames`` frames (a `Sample` video given as its list of frames) in which each shape is
  shown in exactly one frame; "How many shapes appeared over the clip?" → a number, verified by ``number``. Every
  frame must be seen to answer, so keep ``frames`` ≤ ``data.max_frames``. Not among the default tasks.

In ``color`` and ``locate`` the named shape kind occurs exactly once in the image, so the answer is unique.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw, ImageFont

from vlrl.data.sample import Sample
from vlrl.data.tasks import TASK_SUITES, format_prompt, format_response

COLORS = {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 220), "yellow": (230, 190, 20)}
KINDS = ("circle", "square", "triangle")
TASKS = ("count", "color", "locate", "ocr")
VIDEO_TASKS = ("video_count",)
WORDS = (
    "cat", "dog", "sun", "map", "box", "red", "sky", "cup", "hat", "pen", "bus", "car", "fox", "owl", "bee",
    "tree", "fish", "bird", "moon", "star", "door", "lamp", "book", "milk", "rain", "ship", "frog", "wolf",
)


@TASK_SUITES.register("shapes")
def generate_shapes(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    tasks: list[str] | None = None,
    image_size: int = 112,
    max_shapes: int = 4,
    template: str = "answer",
    coords: str = "pixel",
    frames: int = 4,
) -> list[Sample]:
    """Generate ``n`` shapes samples, cycling through ``tasks`` so each task gets an equal share.

    Args:
        image_size: side of the square image in pixels.
        max_shapes: shapes per image are drawn uniformly from 1..max_shapes.
        template: prompt suffix, one of `vlrl.data.tasks.TEMPLATES` ("answer", "think", "none").
        coords: ``"pixel"`` boxes in pixels, or ``"norm1000"`` boxes scaled to 0..1000 (Qwen2-VL style).
        frames: frames per clip of ``video_count``.
    """
    tasks = list(tasks or TASKS)
    unknown = sorted(set(tasks) - set(TASKS) - set(VIDEO_TASKS))
    if unknown:
        raise ValueError(f"shapes: unknown task(s) {unknown}; choose from {list(TASKS + VIDEO_TASKS)}")
    if not 1 <= frames <= 64:
        raise ValueError(f"shapes: frames must be in 1..64, got {frames}")
    if coords not in ("pixel", "norm1000"):
        raise ValueError(f"shapes: coords must be 'pixel' or 'norm1000', got {coords!r}")
    if not 1 <= max_shapes <= 6:
        raise ValueError(f"shapes: max_shapes must be in 1..6, got {max_shapes}")
    samples = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        rng = random.Random(f"shapes/{split}/{seed}/{i}")
        if task == "video_count":
            question, answer, answer_text, reward, clip, meta = _video_count(rng, image_size, max_shapes, frames)
            media, images, videos = "video", [], [clip]
        else:
            make = {"count": _count, "color": _color, "locate": _locate, "ocr": _ocr}[task]
            question, answer, answer_text, reward, image, meta = make(rng, image_size, max_shapes, coords)
            media, images, videos = "image", [image], []
        prompt = format_prompt(question, template)
        samples.append(
            Sample(
                id=f"shapes-{split}-{seed}-{i:06d}",
                task=f"shapes/{task}",
                messages=[{"role": "user", "content": [{"type": media}, {"type": "text", "text": prompt}]}],
                images=images,
                videos=videos,
                answer=answer,
                reward=reward,
                response=format_response(answer_text, template),
                metadata=meta,
            )
        )
    return samples


def _scene(rng: random.Random, size: int, kinds: list[str]) -> tuple[Image.Image, list[dict]]:
    """Draw one shape per entry of ``kinds`` at non-overlapping random places; return image and objects."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    objects: list[dict] = []
    for kind in kinds:
        for _ in range(200):
            side = rng.randint(size // 6, size // 4)
            x1, y1 = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
            box = [x1, y1, x1 + side, y1 + side]
            if all(_apart(box, o["box"], margin=3) for o in objects):
                break
        else:  # pragma: no cover - 6 shapes of <= size/4 always fit
            raise RuntimeError("could not place shapes without overlap")
        color = rng.choice(list(COLORS))
        _draw(draw, kind, box, COLORS[color])
        objects.append({"kind": kind, "color": color, "box": box})
    return image, objects


def _draw(draw: ImageDraw.ImageDraw, kind: str, box: list[int], fill: tuple[int, int, int]) -> None:
    x1, y1, x2, y2 = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=fill)
    else:
        draw.polygon([((x1 + x2) / 2, y1), (x1, y2 - 1), (x2 - 1, y2 - 1)], fill=fill)


def _apart(a: list[int], b: list[int], margin: int) -> bool:
    return a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1]


def _kinds_with_unique(rng: random.Random, max_shapes: int) -> tuple[list[str], str]:
    """A list of shape kinds in which one kind (returned second) occurs exactly once."""
    target = rng.choice(KINDS)
    others = [k for k in KINDS if k != target]
    kinds = [target] + [rng.choice(others) for _ in range(rng.randint(0, max_shapes - 1))]
    rng.shuffle(kinds)
    return kinds, target


def _count(rng, size, max_shapes, coords):
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, max_shapes))]
    image, objects = _scene(rng, size, kinds)
    n = len(objects)
    return "How many shapes are there?", str(n), str(n), "number", image, {"objects": objects}


def _color(rng, size, max_shapes, coords):
    kinds, target = _kinds_with_unique(rng, max_shapes)
    image, objects = _scene(rng, size, kinds)
    color = next(o["color"] for o in objects if o["kind"] == target)
    letters = "ABCD"
    options = list(COLORS)
    question = f"What color is the {target}? " + " ".join(f"{letters[k]}. {c}" for k, c in enumerate(options))
    letter = letters[options.index(color)]
    meta = {"objects": objects, "options": {letters[k]: c for k, c in enumerate(options)}}
    return question, letter, letter, "multiple_choice", image, meta


def _locate(rng, size, max_shapes, coords):
    kinds, target = _kinds_with_unique(rng, max_shapes)
    image, objects = _scene(rng, size, kinds)
    box = next(o["box"] for o in objects if o["kind"] == target)
    if coords == "norm1000":
        box = [round(v * 1000 / size) for v in box]
        unit = "coordinates scaled to 0-1000"
    else:
        unit = f"pixels of the {size}x{size} image"
    question = f"Where is the {target}? Give its bounding box as [x1, y1, x2, y2] in {unit}."
    text = "[" + ", ".join(str(v) for v in box) + "]"
    return question, box, text, "bbox_iou", image, {"objects": objects, "coords": coords}


def _video_count(rng, size, max_shapes, frames):
    """1..max_shapes shapes, each drawn in one random frame of the clip (at most 3 per frame, so they fit)."""
    total = rng.randint(1, min(max_shapes, 3 * frames))
    per_frame = [0] * frames
    for _ in range(total):
        per_frame[rng.choice([f for f in range(frames) if per_frame[f] < 3])] += 1
    clip, objects = [], []
    for f, count in enumerate(per_frame):
        image, shown = _scene(rng, size, [rng.choice(KINDS) for _ in range(count)])
        clip.append(image)
        objects += [{**o, "frame": f} for o in shown]
    question = "How many shapes appeared over the clip?"
    return question, str(total), str(total), "number", clip, {"objects": objects}


def _ocr(rng, size, max_shapes, coords):
    word = rng.choice(WORDS)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(12, size // 5))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = rng.randint(2, max(2, size - (right - left) - 2))
    y = rng.randint(2, max(2, size - (bottom - top) - 2)) - top
    draw.text((x, y), word, fill=rng.choice(list(COLORS.values())), font=font)
    return "What word is written in the image?", word, word, "ocr", image, {}
