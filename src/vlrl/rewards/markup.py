"""Code-as-markup verifiers: ``html`` (WebCode2M-style) and ``svg`` (UniSVG-style).

Both compare the generated source with the reference source. Shared pieces, all multiset Jaccard
(Σ min(a_i, b_i) / Σ max(a_i, b_i) over counts, 1 for two empty multisets), so padding an answer with
extra tokens or tags lowers the score:

* token score — the ``\\w+`` tokens of the source, lower-cased;
* structure score — the root-to-element tag paths (``html>body>div>p``, the last 8 tags of a path), from
  the standard library's ``html.parser`` (lenient; it also reads SVG).

``svg`` adds an image score: SSIM (scikit-image) of the two sources rendered to grey-scale PNGs by CairoSVG
with every external resource refused (no file, network or data: URL is read), XML entities and external
DTDs forbidden (defusedxml, so no billion-laughs), a fixed output size, and CairoSVG's cap on ``<use>``
references. Both run in the worker pool (``mode="pool"``), where the deadline and the worker's memory
limit bound what the parser or renderer may do.

The generated source is the last fenced block (```` ```html ```` / ```` ```svg ```` / ```` ``` ````), else
the response itself; sources longer than ``MAX_SOURCE_CHARS`` score 0.
"""

from __future__ import annotations

import functools
import io
import re
from collections import Counter
from html.parser import HTMLParser
from typing import Any

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.deps import ensure_dependencies, requires
from vlrl.rewards.extract import code_block, strip_special

MAX_SOURCE_CHARS = 200_000
PATH_DEPTH = 8
MAX_OPEN = 512  # deeper nesting is not tracked (keeps end-tag matching O(1) per tag)
_TOKEN = re.compile(r"\w+")
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def multiset_jaccard(a: Counter, b: Counter) -> float:
    """Σ_k min(a_k, b_k) / Σ_k max(a_k, b_k); 1.0 when both are empty."""
    keys = a.keys() | b.keys()
    union = sum(max(a[k], b[k]) for k in keys)
    return 1.0 if union == 0 else sum(min(a[k], b[k]) for k in keys) / union


def token_counts(source: str) -> Counter:
    return Counter(t.lower() for t in _TOKEN.findall(source))


class _TagPaths(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.paths: Counter = Counter()

    def handle_starttag(self, tag, attrs):
        self.paths[">".join([*self.stack[-(PATH_DEPTH - 1):], tag])] += 1
        if tag not in _VOID and len(self.stack) < MAX_OPEN:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.paths[">".join([*self.stack[-(PATH_DEPTH - 1):], tag])] += 1

    def handle_endtag(self, tag):
        if tag in self.stack:  # close up to the matching open tag (lenient, like browsers)
            while self.stack and self.stack.pop() != tag:
                pass


def tag_paths(source: str) -> Counter:
    """Multiset of root-to-element tag paths (last ``PATH_DEPTH`` tags), e.g. ``{"html>body>p": 2}``."""
    parser = _TagPaths()
    parser.feed(source)
    parser.close()
    return parser.paths


def markup_source(response: str, languages: tuple[str, ...]) -> str:
    """The generated source: the last fenced block in ``languages``, else the whole response."""
    block = code_block(response, languages)
    return (block if block is not None else strip_special(response)).strip()


@register_reward("html", mode="pool", deadline=10.0)
def html(response: str, answer: Any, **meta: Any) -> RewardOutput:
    """R = 0.6 · TokenJaccard + 0.4 · TagJaccard, clipped to [0, 1] (LLaVA-OV-1.5 ``reward/htmlcode.py``).

    ``answer``: the reference HTML source. Parts: ``token``, ``structure``.
    """
    source = markup_source(response, ("html", "htm", "xml", ""))
    if len(source) > MAX_SOURCE_CHARS or not source:
        return RewardOutput(overall=0.0, parts={"token": 0.0, "structure": 0.0})
    reference = str(answer)
    token = multiset_jaccard(token_counts(source), token_counts(reference))
    structure = multiset_jaccard(tag_paths(source), tag_paths(reference))
    return RewardOutput(overall=max(0.0, min(1.0, 0.6 * token + 0.4 * structure)),
                        parts={"token": token, "structure": structure})


def _refuse_url(url: str, resource_type: str) -> bytes:
    """CairoSVG url_fetcher that reads nothing: every external reference renders as an empty image."""
    return b'<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>'


def render_svg(source: str, size: int = 128):
    """Grey-scale (size, size) uint8 array of ``source`` rendered on white; raises if it does not render."""
    import cairosvg.surface
    import numpy as np
    from PIL import Image

    png = cairosvg.surface.PNGSurface.convert(
        bytestring=source.encode("utf-8"), output_width=size, output_height=size, unsafe=False,
        url_fetcher=_refuse_url, background_color="white",
    )
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("L").resize((size, size)))


@functools.lru_cache(maxsize=256)
def _reference_render(source: str, size: int):
    return render_svg(source, size)


@register_reward("svg", mode="pool", deadline=15.0)
@requires("cairosvg", "skimage", extra="rewards")
def svg(response: str, answer: Any, *, size: int = 128, **meta: Any) -> RewardOutput:
    """R = 0.5 · SSIM(render(gen), render(ref)) + 0.25 · (TokenJaccard + TagJaccard) ∈ [0, 1]
    (LLaVA-OV-1.5 ``reward/svgcode.py``).

    ``answer``: the reference SVG source. SSIM is clipped to [0, 1]; an SVG that does not render (bad XML,
    entities, ...) gets image score 0. Parts: ``image``, ``token``, ``structure``, ``renders``.
    """
    ensure_dependencies(svg, "svg")  # a missing renderer must not pass for "does not render"
    from skimage.metrics import structural_similarity

    source = markup_source(response, ("svg", "xml", "html", ""))
    if len(source) > MAX_SOURCE_CHARS or "<svg" not in source:
        return RewardOutput(overall=0.0, parts={"image": 0.0, "token": 0.0, "structure": 0.0, "renders": 0.0})
    reference = str(answer)
    token = multiset_jaccard(token_counts(source), token_counts(reference))
    structure = multiset_jaccard(tag_paths(source), tag_paths(reference))
    try:
        image = render_svg(source, size)
        renders = 1.0
    except Exception:  # invalid or forbidden SVG: no image credit  # noqa: BLE001
        image, renders = None, 0.0
    image_score = 0.0
    if image is not None:
        ssim = structural_similarity(image, _reference_render(reference, size), data_range=255)
        image_score = max(0.0, min(1.0, float(ssim)))
    overall = 0.5 * image_score + 0.25 * (token + structure)
    return RewardOutput(overall=overall, parts={"image": image_score, "token": token, "structure": structure,
                                                "renders": renders})
