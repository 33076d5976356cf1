"""`numerics: portable` (vlrl/numerics.py): the CPU kernels capped at AVX2 through the libraries' own switches,
applied by the CLI before the run's first tensor operation, refused with a clear message where it cannot take
effect, and recorded in summary.json.

Each case runs in a fresh process: a library reads its switch once, at its first computation, and this test
process computed long ago. That a portable run gives the same bits on another Intel CPU was measured under
emulation (docs/experiments/demo.md, "Portable numerics"), not here: CI has one CPU.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlrl.numerics import PORTABLE_ENV

TINY_DEMO = ["seed=0", "data.n_train=16", "data.n_test=2", "sft.train.steps=2", "sft.train.batch_size=4",
             "sft.train.micro_batch_size=4", "sft.train.log_every=1", "rl.train.steps=1", "rl.train.prompts_per_step=2",
             "rl.rollout.n=4", "rl.train.micro_batch_size=8", "control=false", "eval.samples=1",
             'report.progress="off"', "report.html=false"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True, timeout=120)


def native_capability() -> str:
    return python("import torch; print(torch.backends.cpu.get_cpu_capability())").stdout.strip()


def test_portable_caps_the_kernels_at_avx2_before_the_first_operation():
    probe = ("from vlrl.numerics import apply_numerics, describe_mkl, mkl_branch; apply_numerics('portable'); "
             "import torch; print(torch.backends.cpu.get_cpu_capability(), describe_mkl(mkl_branch()))")
    done = python(probe)
    if native_capability() == "DEFAULT":  # a CPU without AVX2 (or not x86): portable cannot match an AVX2 machine
        assert done.returncode != 0 and "has no AVX2" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    kernels, mkl = done.stdout.split()
    assert kernels == "AVX2"
    assert mkl in ("AVX2,STRICT", "None")  # None: a torch build without MKL


def test_portable_after_a_tensor_operation_is_refused_with_the_fix():
    done = python("import torch; torch.ones(64, 64) @ torch.ones(64, 64); torch.ones(3).exp(); "
                  "from vlrl.numerics import apply_numerics; apply_numerics('portable')")
    assert done.returncode != 0
    if native_capability() == "DEFAULT":
        assert "has no AVX2" in done.stderr
    else:  # ATen's kernels (on AVX-512 CPUs) or MKL's branch (everywhere: it was "off") were already chosen
        assert "before the process's first tensor operation" in done.stderr and "MKL_CBWR=AVX2,STRICT" in done.stderr


def test_portable_refuses_a_conflicting_environment():
    done = python("from vlrl.numerics import apply_numerics; apply_numerics('portable')", ATEN_CPU_CAPABILITY="avx512")
    assert done.returncode != 0 and "ATEN_CPU_CAPABILITY" in done.stderr and "avx512" in done.stderr


def _demo(out: Path, *extra: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "vlrl.cli", "demo", "--out", str(out), *TINY_DEMO, *extra],
                          env=clean_env(**env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["weights"] = {stage: hashlib.sha256((out / "checkpoints" / stage / "model.safetensors").read_bytes()).hexdigest()
                          for stage in ("sft", "rl")}
    return summary


@pytest.mark.e2e
def test_vlrl_demo_numerics_portable_equals_the_libraries_own_switches(tmp_path):
    """Through the CLI: `numerics=portable` is recorded in summary.json, and its weights are bit for bit those of
    the same run with numerics=native and the three switches set in the environment before start — so all three (oneDNN's, which
    nothing reports, included: without it the weights differ) took effect in time."""
    if native_capability() == "DEFAULT":  # no AVX2: refused (test above), nothing to compare
        done = subprocess.run([sys.executable, "-m", "vlrl.cli", "demo", "--out", str(tmp_path), *TINY_DEMO,
                               "numerics=portable"], env=clean_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "has no AVX2" in done.stderr
        return
    portable = _demo(tmp_path / "portable", "numerics=portable")
    by_env = _demo(tmp_path / "by_env", "numerics=native", **PORTABLE_ENV)  # the CLI sets nothing
    env = portable["environment"]
    assert env["numerics"] == "portable" and env["cpu_kernels"] == "AVX2" and env["cpu"]
    assert env["mkl_cbwr"] in ("AVX2,STRICT", None)
    assert by_env["environment"]["numerics"] == "portable"  # the same switches, set from outside, are recognised
    assert portable["weights"] == by_env["weights"]
    assert portable["sft"] == by_env["sft"] and portable["rl"] == by_env["rl"]
    # and the mode is not a no-op: native kernels round otherwise — on AVX-512 CPUs (ATen's and MKL's own branches)
    # and on AVX2 ones too (MKL's non-strict AVX2 branch: measured on an emulated Haswell)
    native = _demo(tmp_path / "native", "numerics=native")  # demo.yaml says portable
    assert native["environment"]["numerics"] == "native"
    assert native["weights"]["sft"] != portable["weights"]["sft"]
