"""`vlrl --version` and `vlrl env`: the block a bug report pastes, built on what summary.json records."""

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.numerics import PORTABLE_ENV, cpu_name
from vlrl.report import environment as env_module
from vlrl.report.environment import environment, extras

ROOT = Path(__file__).parents[2]


def _fields(text: str) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def test_version_through_the_cli_script():
    result = subprocess.run([sys.executable, "-m", "vlrl.cli", "--version"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"vlrl {metadata.version('vlrl')}"


def test_env_prints_one_block_with_every_field():
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    fields = _fields(result.output)
    assert list(fields) == ["vlrl", "python", "packages", "cpu", "cpu isa", "torch threads", "numerics", "cuda",
                            "extras"]
    assert fields["vlrl"].startswith(metadata.version("vlrl") + " (")
    assert fields["python"].startswith(platform.python_version())
    packages = fields["packages"].split(", ")
    for name in ("torch", "transformers", "tokenizers", "numpy", "pillow", "httpx"):  # core ones, httpx included
        assert f"{name} {metadata.version(name)}" in packages
    assert fields["cpu"].startswith(str(cpu_name()))
    assert f"torch kernels {torch.backends.cpu.get_cpu_capability()}" in fields["cpu isa"]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
        for flag in ("avx2", "avx512f", "amx_tile"):
            assert (flag in fields["cpu isa"].split()) == (flag in flags), flag
    assert fields["torch threads"].startswith(f"{torch.get_num_threads()} (")
    assert fields["numerics"].startswith(environment()["numerics"] + " (")
    if torch.version.cuda is None:
        assert fields["cuda"] == "none (a CPU build of torch)"
    else:
        assert fields["cuda"].startswith(f"{torch.version.cuda} · ")
    provided = [e for e in metadata.metadata("vlrl").get_all("Provides-Extra") if e not in ("dev", "all")]
    assert [part.split(" (")[0] for part in fields["extras"].split(", ")] == provided


def test_env_says_portable_numerics_when_the_switches_are_set():
    result = subprocess.run([sys.executable, "-m", "vlrl.cli", "env"], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**os.environ, **PORTABLE_ENV})
    assert result.returncode == 0, result.stderr
    numerics = _fields(result.stdout)["numerics"]
    assert numerics.startswith("portable (") and "MKL_CBWR=AVX2,STRICT" in numerics


def test_an_extra_with_a_missing_package_names_it(monkeypatch):
    real = metadata.version

    def version(name):
        if name == "matplotlib":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(env_module.metadata, "version", version)
    found = extras()
    assert found["report"] == ["matplotlib"]
    assert "matplotlib" not in found["rewards"]
