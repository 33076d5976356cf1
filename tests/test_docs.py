"""The documentation: the site under docs/ builds strictly (a broken link, a missing anchor, a page outside the
nav or a nav entry without a page fails), its reference tables are generated from the code, and the README and
ARCHITECTURE.md stay the short maps issue 37 asked for."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def _hooks():
    spec = importlib.util.spec_from_file_location("vlrl_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:  # every page was written (mkdocs' directory URLs: guides/agents.md → guides/agents/)
        index = site / ("index.html" if page == "index" else f"{page.removesuffix('/index')}/index.html")
        assert index.is_file(), page
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "generated:" not in config and "RolloutConfig" in config and "max_new_tokens" in config
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "vlrl rl" in cli and "--config" in cli


def test_the_config_reference_is_every_field_of_config_py():
    """The page holds the generator's marker, not a hand-written table, and the generator writes every field of
    every section reachable from the three run configs, with its description."""
    from pydantic import BaseModel

    from vlrl.config import DemoConfig, RLConfig, SFTConfig

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert "<!-- generated: config -->" in page
    assert not re.search(r"^\| `(model|rollout|algo|train)\.", page, re.M), "a hand-written field table"
    text = _hooks().config_reference()
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        assert f"### {cls.__name__}" in text
        for name, field in cls.model_fields.items():
            assert f"| `{name}` |" in text, f"{cls.__name__}.{name}"
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            assert description and description in text, f"{cls.__name__}.{name} has no description on the page"
            for arg in [field.annotation, *_args(field.annotation)]:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg)

    for root in (SFTConfig, RLConfig, DemoConfig):
        walk(root)
    assert len(seen) > 10


def _args(annotation):
    import typing

    out = []
    for arg in typing.get_args(annotation):
        out += [arg, *_args(arg)]
    return out


@pytest.mark.parametrize("name", ["config", "cli", "registries", "metrics", "presets", "rollout_moves", "gpu_plan"])
def test_every_generator_is_used_by_a_page(name):
    pages = "".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    assert f"<!-- generated: {name} -->" in pages


def test_the_readme_is_short_opens_with_the_two_commands_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("```bash") < text.index("\n## "), "the two commands come before the first section"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README links to a missing {target}"
    for section in ("verl", "AReaL", "slime", "TRL", "EasyR1"):
        assert f"| {section} |" in text or f" {section} |" in text


def test_architecture_is_short_and_names_existing_places():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 150
    for path in re.findall(r"`(src/vlrl/[A-Za-z0-9_/.]+|tests/[A-Za-z0-9_/.]+)`", text):
        assert (ROOT / path.rstrip("/")).exists(), f"ARCHITECTURE.md names a missing {path}"
