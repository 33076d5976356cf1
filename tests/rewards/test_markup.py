from collections import Counter

import numpy as np
import pytest
from PIL import Image

from vlrl.rewards import get_reward
from vlrl.rewards.markup import multiset_jaccard, render_svg, tag_paths

SQUARE = '<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect x="8" y="8" width="48" height="48" fill="red"/></svg>'


def test_multiset_jaccard_by_hand():
    # min counts: a 1, b 1 = 2; max counts: a 2, b 1, c 1 = 4
    assert multiset_jaccard(Counter("aab"), Counter("abc")) == pytest.approx(0.5)
    assert multiset_jaccard(Counter(), Counter()) == 1.0


def test_tag_paths():
    assert tag_paths("<html><body><p>a</p><p>b<br></p></body></html>") == Counter(
        {"html": 1, "html>body": 1, "html>body>p": 2, "html>body>p>br": 1})


def test_html_by_hand():
    html = get_reward("html")
    assert html("```html\n<p>a b</p>\n```", "<p>a b</p>").overall == pytest.approx(1.0)
    # tokens: gen {p: 2, a: 1}, ref {p: 2, a: 1, b: 1} → 3/4; structure {p} both → 1; 0.6·0.75 + 0.4·1 = 0.85
    out = html("<p>a</p>", "<p>a b</p>")
    assert out.overall == pytest.approx(0.85) and out.parts == pytest.approx({"token": 0.75, "structure": 1.0})
    assert html("", "<p>a</p>").overall == 0.0


def test_svg_identical_and_different():
    svg = get_reward("svg")
    out = svg(f"```svg\n{SQUARE}\n```", SQUARE)
    assert out.overall == pytest.approx(1.0) and out.parts["renders"] == 1.0
    blue = SQUARE.replace("red", "blue").replace('x="8"', 'x="30"')
    out = svg(blue, SQUARE)
    assert out.parts["image"] < 0.9 and out.overall < 0.95
    assert svg("no svg here", SQUARE).overall == 0.0


def test_svg_never_reads_external_files(tmp_path):
    # a red PNG on disk, referenced by file:// and by a relative path: the render must stay blank (white)
    Image.new("RGB", (64, 64), (255, 0, 0)).save(tmp_path / "red.png")
    for href in (f"file://{tmp_path}/red.png", str(tmp_path / "red.png")):
        source = (f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" width="64" '
                  f'height="64"><image xlink:href="{href}" width="64" height="64"/></svg>')
        assert np.all(render_svg(source, 32) == 255)


def test_svg_entities_do_not_render():
    laughs = ('<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;&a;">]>'
              '<svg xmlns="http://www.w3.org/2000/svg"><text>&b;</text></svg>')
    with pytest.raises(Exception):  # noqa: B017 - defusedxml's EntitiesForbidden
        render_svg(laughs)
    out = get_reward("svg")(laughs, SQUARE)
    assert out.parts["renders"] == 0.0 and out.parts["image"] == 0.0
