"""Procedural background textures steered by the keywords of a description (the `classical` back-end).

`texture_for(description, (H, W), seed)` reads colour words (``red``, ``navy``, ...), scene words that imply a
palette and a pattern (``grass``, ``ocean``, ``brick wall``, ``desert``, ``night sky``, ...), pattern words
(``stripes``, ``checkered``, ``dots``, ``waves``, ``clouds``, ``gradient``, ``plain``, ...) and modifiers
(``dark``, ``bright``, ``busy`` / ``cluttered``), and draws an (H, W, 3) float image in [0, 1]. Words it does
not know still matter: the description's hash picks the pattern and palette then, so different descriptions
give different backgrounds, and the same (description, seed) always gives the same one.

Everything is numpy plus PIL resizes (C code), so a 448 × 448 texture takes milliseconds.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (200, 40, 40), "green": (50, 150, 60), "blue": (40, 90, 200), "yellow": (230, 200, 40),
    "orange": (235, 130, 30), "purple": (120, 60, 160), "violet": (140, 90, 200), "pink": (235, 140, 180),
    "brown": (120, 80, 40), "black": (20, 20, 20), "white": (245, 245, 245), "gray": (128, 128, 128),
    "grey": (128, 128, 128), "cyan": (40, 200, 210), "teal": (30, 128, 128), "gold": (212, 175, 55),
    "silver": (192, 192, 200), "beige": (225, 210, 170), "navy": (20, 30, 90), "maroon": (110, 20, 30),
    "olive": (110, 120, 40), "turquoise": (60, 210, 200), "magenta": (200, 40, 160), "cream": (245, 235, 200),
}

# scene word → (palette, pattern)
SCENES: dict[str, tuple[list[tuple[int, int, int]], str]] = {
    "grass": ([(60, 140, 50), (100, 170, 60), (40, 100, 40)], "grain"),
    "forest": ([(30, 80, 35), (60, 110, 50), (90, 70, 40)], "clouds"),
    "jungle": ([(20, 90, 30), (70, 150, 50), (30, 60, 20)], "clouds"),
    "sky": ([(120, 170, 235), (200, 225, 250), (90, 140, 220)], "gradient"),
    "ocean": ([(20, 70, 140), (40, 120, 180), (10, 40, 100)], "waves"),
    "sea": ([(20, 80, 150), (60, 140, 190), (15, 50, 110)], "waves"),
    "water": ([(40, 110, 180), (90, 160, 210), (20, 70, 140)], "waves"),
    "river": ([(50, 110, 150), (90, 150, 170), (60, 120, 80)], "waves"),
    "lake": ([(40, 100, 150), (110, 160, 200), (30, 80, 110)], "waves"),
    "desert": ([(220, 190, 130), (200, 160, 100), (240, 215, 160)], "waves"),
    "sand": ([(225, 200, 150), (200, 175, 120), (240, 220, 175)], "grain"),
    "beach": ([(235, 215, 160), (80, 160, 210), (250, 240, 210)], "gradient"),
    "snow": ([(245, 248, 252), (220, 230, 245), (200, 215, 235)], "clouds"),
    "ice": ([(200, 230, 245), (170, 210, 235), (235, 245, 250)], "clouds"),
    "night": ([(10, 15, 40), (30, 30, 70), (5, 5, 15)], "dots"),
    "space": ([(5, 5, 20), (40, 20, 70), (0, 0, 0)], "dots"),
    "fire": ([(240, 120, 20), (220, 40, 20), (250, 200, 50)], "clouds"),
    "sunset": ([(250, 150, 60), (220, 80, 90), (110, 60, 140)], "gradient"),
    "lava": ([(200, 40, 10), (250, 140, 20), (60, 10, 10)], "clouds"),
    "wood": ([(140, 95, 50), (110, 70, 35), (170, 120, 70)], "grain"),
    "brick": ([(160, 60, 45), (130, 45, 35), (200, 190, 180)], "bricks"),
    "wall": ([(190, 180, 165), (160, 150, 135), (210, 205, 195)], "bricks"),
    "stone": ([(130, 130, 125), (100, 100, 95), (160, 160, 150)], "clouds"),
    "concrete": ([(150, 150, 145), (120, 120, 118), (175, 175, 170)], "grain"),
    "road": ([(70, 70, 72), (90, 90, 92), (220, 200, 60)], "stripes"),
    "street": ([(80, 80, 82), (110, 110, 112), (200, 200, 200)], "grid"),
    "city": ([(110, 110, 120), (150, 150, 160), (60, 60, 70)], "grid"),
    "kitchen": ([(230, 225, 210), (180, 150, 110), (240, 240, 240)], "checker"),
    "floor": ([(180, 150, 110), (150, 120, 85), (200, 175, 140)], "checker"),
    "carpet": ([(150, 40, 50), (180, 140, 60), (60, 40, 90)], "dots"),
    "garden": ([(70, 150, 60), (230, 90, 120), (240, 210, 60)], "dots"),
    "flowers": ([(230, 90, 140), (250, 220, 60), (90, 160, 70)], "dots"),
    "clouds": ([(230, 235, 245), (180, 200, 230), (250, 250, 255)], "clouds"),
    "fog": ([(200, 205, 210), (170, 175, 180), (225, 228, 230)], "clouds"),
}

PATTERNS = ("noise", "clouds", "stripes", "checker", "dots", "waves", "gradient", "bricks", "grain", "grid", "plain")
PATTERN_WORDS: dict[str, str] = {
    "noise": "noise", "noisy": "noise", "gravel": "noise", "speckled": "noise", "static": "noise",
    "cloud": "clouds", "cloudy": "clouds", "smoke": "clouds", "smoky": "clouds", "marble": "clouds", "misty": "clouds",
    "stripe": "stripes", "stripes": "stripes", "striped": "stripes", "lines": "stripes", "zebra": "stripes",
    "checker": "checker", "checkered": "checker", "checkerboard": "checker", "chess": "checker", "tiles": "checker",
    "tiled": "checker", "dots": "dots", "dotted": "dots", "spots": "dots", "spotted": "dots", "polka": "dots",
    "stars": "dots", "starry": "dots", "wave": "waves", "waves": "waves", "wavy": "waves", "ripples": "waves",
    "dunes": "waves", "gradient": "gradient", "fading": "gradient", "horizon": "gradient",
    "bricks": "bricks", "brick": "bricks", "grain": "grain", "grainy": "grain", "fabric": "grain",
    "grid": "grid", "mesh": "grid", "windows": "grid", "plain": "plain", "solid": "plain", "empty": "plain",
    "blank": "plain", "uniform": "plain",
}
DARK = {"dark", "night", "dim", "shadowy", "gloomy", "black"}
BRIGHT = {"bright", "light", "pale", "sunny", "pastel", "white"}
BUSY = {"busy", "cluttered", "complex", "messy", "crowded", "chaotic", "detailed", "textured"}

_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class TextureSpec:
    """What a description asked for: pattern, palette (RGB 0..255), modifiers, and the words that steered it."""

    pattern: str
    palette: tuple[tuple[int, int, int], ...]
    dark: bool
    bright: bool
    busy: bool
    keywords: tuple[str, ...]


def parse_description(description: str) -> TextureSpec:
    """Map the description's words to a `TextureSpec` (unknown words: pattern and palette from its hash)."""
    words = _WORD.findall(description.lower())
    digest = int.from_bytes(hashlib.sha256(description.strip().lower().encode()).digest()[:8], "little")
    palette: list[tuple[int, int, int]] = []
    pattern: str | None = None
    keywords: list[str] = []
    for word in words:
        singular = word[:-1] if word.endswith("s") and word[:-1] in SCENES else word
        if singular in SCENES:
            scene_palette, scene_pattern = SCENES[singular]
            palette.extend(scene_palette)
            pattern = pattern or scene_pattern
            keywords.append(singular)
        if word in PATTERN_WORDS:
            pattern = PATTERN_WORDS[word]  # an explicit pattern word wins over a scene's default
            keywords.append(word)
        if word in COLOURS:
            palette.insert(0, COLOURS[word])  # explicit colours first
            keywords.append(word)
    if pattern is None:
        pattern = PATTERNS[digest % (len(PATTERNS) - 1)]  # never "plain" by chance
    if not palette:
        rng = np.random.default_rng(digest)
        palette = [tuple(int(v) for v in rng.integers(30, 230, size=3)) for _ in range(3)]
    elif len(palette) == 1:
        base = np.array(palette[0], dtype=float)
        palette.append(tuple(int(v) for v in np.clip(base * 0.6, 0, 255)))
        palette.append(tuple(int(v) for v in np.clip(base + (255 - base) * 0.5, 0, 255)))
    flags = set(words)
    return TextureSpec(pattern, tuple(palette[:4]), bool(flags & DARK), bool(flags & BRIGHT), bool(flags & BUSY),
                       tuple(dict.fromkeys(keywords)))


def texture_for(description: str, size: tuple[int, int], seed: int) -> tuple[np.ndarray, TextureSpec]:
    """An (H, W, 3) float texture in [0, 1] for ``description`` (``size`` = (H, W)), and its `TextureSpec`."""
    spec = parse_description(description)
    H, W = size
    rng = np.random.default_rng([seed & 0xFFFFFFFF, int(hashlib.sha256(description.encode()).hexdigest()[:8], 16)])
    scale = max(H, W)
    frequency = 2.0 if spec.busy else 1.0
    field = _pattern(spec.pattern, H, W, rng, scale, frequency)  # (H, W) in [0, 1]
    image = _colourise(field, np.array(spec.palette, dtype=float) / 255.0)  # (H, W, 3)
    grain = _value_noise(H, W, rng, cells=max(4, scale // 6), octaves=1)
    image = image * (0.92 + 0.16 * grain[..., None])  # a little fine texture everywhere
    if spec.busy:
        image = _clutter(image, rng, scale, np.array(spec.palette, dtype=float) / 255.0)
    if spec.dark:
        image = image * 0.45
    if spec.bright:
        image = image * 0.6 + 0.4
    return np.clip(image, 0.0, 1.0), spec


# ----------------------------------------------------------------------------------------------- patterns
def _pattern(name: str, H: int, W: int, rng: np.random.Generator, scale: int, frequency: float) -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W].astype(np.float32) / scale
    angle = rng.uniform(0, np.pi)
    period = rng.uniform(0.06, 0.16) / frequency
    if name == "noise":
        return _value_noise(H, W, rng, cells=int(8 * frequency) + 4, octaves=4)
    if name == "clouds":
        return _value_noise(H, W, rng, cells=int(3 * frequency) + 1, octaves=5)
    if name == "stripes":
        u = x * np.cos(angle) + y * np.sin(angle)
        return (np.sin(2 * np.pi * u / period) > 0).astype(np.float32) * 0.8 + 0.1
    if name == "checker":
        return (((x // period).astype(int) + (y // period).astype(int)) % 2).astype(np.float32)
    if name == "dots":
        cx, cy = (x % period) / period - 0.5, (y % period) / period - 0.5
        radius = rng.uniform(0.15, 0.35)
        return ((cx**2 + cy**2) < radius**2).astype(np.float32) * 0.9 + 0.05
    if name == "waves":
        u = y + 0.04 * np.sin(2 * np.pi * x / rng.uniform(0.2, 0.5))
        return 0.5 + 0.5 * np.sin(2 * np.pi * u / period)
    if name == "gradient":
        u = (x * np.cos(angle) + y * np.sin(angle)) * scale / max(H, W)
        u = (u - u.min()) / max(float(u.max() - u.min()), 1e-6)
        return 0.8 * u + 0.2 * _value_noise(H, W, rng, cells=3, octaves=2)
    if name == "bricks":
        row = (y // (period * 0.5)).astype(int)
        shifted = x + (row % 2) * period * 0.5
        mortar = ((y % (period * 0.5)) < period * 0.06) | ((shifted % period) < period * 0.06)
        return np.where(mortar, 1.0, 0.15 + 0.25 * _value_noise(H, W, rng, cells=6, octaves=2)).astype(np.float32)
    if name == "grain":
        stretched = _value_noise(max(2, H // 8), W, rng, cells=int(16 * frequency), octaves=3)
        return np.asarray(Image.fromarray(stretched.astype(np.float32), mode="F").resize((W, H), Image.BILINEAR))
    if name == "grid":
        line = period * 0.08
        return (((x % period) < line) | ((y % period) < line)).astype(np.float32) * 0.8 + 0.1
    if name == "plain":
        return np.full((H, W), rng.uniform(0.3, 0.7), dtype=np.float32)
    raise ValueError(f"unknown pattern {name!r}; choose from {PATTERNS}")


def _value_noise(H: int, W: int, rng: np.random.Generator, *, cells: int, octaves: int) -> np.ndarray:
    """Fractal value noise in [0, 1]: random grids of cells × cells, 2 × cells, ... upsampled bicubically."""
    total = np.zeros((H, W), dtype=np.float32)
    amplitude, weight = 1.0, 0.0
    for octave in range(octaves):
        n = max(2, cells * 2**octave)
        grid = rng.random((n, n)).astype(np.float32)
        total += amplitude * np.asarray(Image.fromarray(grid, mode="F").resize((W, H), Image.BICUBIC))
        weight += amplitude
        amplitude *= 0.5
    total /= weight
    low, high = float(total.min()), float(total.max())
    return (total - low) / max(high - low, 1e-6)


def _colourise(field: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """Map a [0, 1] field through the palette's colours (piecewise linear), (H, W) → (H, W, 3)."""
    stops = np.linspace(0.0, 1.0, len(palette))
    return np.stack([np.interp(field, stops, palette[:, c]) for c in range(3)], axis=-1)


def _clutter(image: np.ndarray, rng: np.random.Generator, scale: int, palette: np.ndarray) -> np.ndarray:
    """Random thin strokes in the palette's colours: a busier background (no filled shapes)."""
    from PIL import ImageDraw

    canvas = Image.fromarray((np.clip(image, 0, 1) * 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    H, W = image.shape[:2]
    for _ in range(int(rng.integers(8, 20))):
        points = [(float(rng.uniform(0, W)), float(rng.uniform(0, H))) for _ in range(int(rng.integers(2, 5)))]
        colour = tuple(int(v * 255) for v in palette[int(rng.integers(len(palette)))][::-1])
        draw.line(points, fill=colour, width=max(1, scale // 100))
    return np.asarray(canvas, dtype=np.float32) / 255.0
