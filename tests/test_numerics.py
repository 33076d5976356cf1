"""`numerics: portable` (vlrl/numerics.py): the CPU kernels capped at AVX2 through the libraries' own switches,
applied by the CLI before the run's first tensor operation, refused with its real cause where it cannot take
effect (a CPU that is not Intel's, no AVX2, no MKL), and recorded in summary.json; `numerics: auto` takes it where
it can and native kernels elsewhere, saying which.

Which branch a test takes depends on the CPU it runs on — CI's is an Intel Xeon on some days and an AMD EPYC on
others: on an Intel CPU with AVX2 the portable mode is checked to take effect, elsewhere to be refused with the
CPU named (and the bit-equality check, which needs the mode, is skipped with that reason). Each case runs in a
fresh process: a library reads its switch once, at its first computation, and this test process computed long
ago. That a portable run gives the same bits on another Intel CPU was measured under emulation
(docs/experiments/demo.md, "Portable numerics"), not here: CI has one CPU.
"""

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from vlrl.numerics import PORTABLE_ENV, portable_obstacle

OBSTACLE = portable_obstacle()  # None on an Intel CPU with AVX2 (and a torch with MKL): portable can take effect

TINY_DEMO = ["seed=0", "data.n_train=16", "data.n_test=2", "sft.train.steps=2", "sft.train.batch_size=4",
             "sft.train.micro_batch_size=4", "sft.train.log_every=1", "rl.train.steps=1", "rl.train.prompts_per_step=2",
             "rl.rollout.n=4", "rl.train.micro_batch_size=8", "control=false", "eval.samples=1",
             'report.progress="off"', "report.html=false"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True, timeout=120)


def test_portable_caps_the_kernels_at_avx2_before_the_first_operation():
    probe = ("from vlrl.numerics import apply_numerics, describe_mkl, mkl_branch; apply_numerics('portable'); "
             "import torch; print(torch.backends.cpu.get_cpu_capability(), describe_mkl(mkl_branch()))")
    done = python(probe)
    if OBSTACLE is not None:  # e.g. an AMD CPU: refused, naming the CPU — not "run in a fresh process"
        assert done.returncode != 0 and OBSTACLE in done.stderr and "numerics=auto" in done.stderr
        assert "fresh process" not in done.stderr
        return
    assert done.returncode == 0, done.stderr
    kernels, mkl = done.stdout.split()
    assert kernels == "AVX2"
    assert mkl == "AVX2,STRICT"


def test_auto_is_portable_where_it_can_be_and_native_elsewhere():
    probe = ("import os; from vlrl.numerics import apply_numerics; a = apply_numerics('auto'); "
             "print(a.mode, '|', a.reason, '|', os.environ.get('MKL_CBWR'))")
    done = python(probe)
    assert done.returncode == 0, done.stderr
    mode, reason, mkl_env = (part.strip() for part in done.stdout.split("|"))
    if OBSTACLE is not None:  # nothing pinned: each library's own kernels, and the reason kept for summary.json
        assert (mode, reason, mkl_env) == ("native", OBSTACLE, "None")
    else:
        assert (mode, mkl_env) == ("portable", "AVX2,STRICT")


@pytest.mark.parametrize("vendor, model, flags, cause", [
    ("AuthenticAMD", "AMD EPYC 9654", "fpu avx2 avx512f", "only on Intel CPUs, and this one is AMD EPYC 9654 (AuthenticAMD)"),
    ("GenuineIntel", "Intel(R) Xeon(R) E5-2680", "fpu sse4_2 avx", "has no AVX2"),
    ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", "fpu avx2 avx512f amx_tile", None),
])
def test_the_cause_is_read_from_the_cpus_description(tmp_path, vendor, model, flags, cause):
    """Whatever CPU runs the suite, the rule is checked on each vendor's description (/proc/cpuinfo's format);
    the machine's own CPU is checked by the tests above."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the vendor rule applies to x86 CPUs; this machine is {platform.machine()}")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n")
    obstacle = portable_obstacle(cpuinfo=cpuinfo)
    if cause is None:  # an Intel CPU with AVX2 (this x86-64 torch has MKL)
        assert obstacle is None
    else:
        assert obstacle is not None and cause in obstacle


def test_portable_after_a_tensor_operation_is_refused_with_the_fix():
    done = python("import torch; torch.ones(64, 64) @ torch.ones(64, 64); torch.ones(3).exp(); "
                  "from vlrl.numerics import apply_numerics; apply_numerics('portable')")
    assert done.returncode != 0
    if OBSTACLE is not None:  # the CPU is the cause, whatever ran before
        assert OBSTACLE in done.stderr
    else:  # ATen's kernels (on AVX-512 CPUs) or MKL's branch (everywhere: it was "off") were already chosen
        assert "before the process's first tensor operation" in done.stderr and "MKL_CBWR=AVX2,STRICT" in done.stderr


def test_portable_refuses_a_conflicting_environment():
    done = python("from vlrl.numerics import apply_numerics; apply_numerics('portable')", ATEN_CPU_CAPABILITY="avx512")
    assert done.returncode != 0
    if OBSTACLE is not None:
        assert OBSTACLE in done.stderr
    else:
        assert "ATEN_CPU_CAPABILITY" in done.stderr and "avx512" in done.stderr


def _demo(out: Path, *extra: str, **env: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-m", "vlrl.cli", "demo", "--out", str(out), *TINY_DEMO, *extra],
                          env=clean_env(**env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["weights"] = {stage: hashlib.sha256((out / "checkpoints" / stage / "model.safetensors").read_bytes()).hexdigest()
                          for stage in ("sft", "rl")}
    return summary, done.stdout + done.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``demo(name, *overrides, **env)``: (summary.json with the checkpoints' hashes, the run's output) of one tiny `vlrl
    demo` in a process of its own — each distinct run made once for the module (the two tests below share the run
    in the chosen mode)."""
    runs: dict[tuple, tuple[dict, str]] = {}

    def run(name: str, *extra: str, **env: str) -> tuple[dict, str]:
        key = (extra, tuple(sorted(env.items())))
        if key not in runs:
            runs[key] = _demo(tmp_path_factory.mktemp(name), *extra, **env)
        return runs[key]

    return run


@pytest.mark.e2e
def test_vlrl_demo_numerics_portable_equals_the_libraries_own_switches(demo):
    """Through the CLI: `numerics=portable` is recorded in summary.json, and its weights are bit for bit those of
    the same run with numerics=native and the three switches set in the environment before start — so all three (oneDNN's, which
    nothing reports, included: without it the weights differ) took effect in time."""
    if OBSTACLE is not None:  # e.g. an AMD CPU: there is no portable mode to compare (refusal: the tests above)
        pytest.skip(f"numerics=portable cannot take effect on this CPU: {OBSTACLE}")
    portable, _ = demo("portable", "numerics=portable")
    by_env, _ = demo("by_env", "numerics=native", **PORTABLE_ENV)  # the CLI sets nothing
    env = portable["environment"]
    assert env["numerics"] == "portable" and env["cpu_kernels"] == "AVX2" and env["cpu"]
    assert env["mkl_cbwr"] in ("AVX2,STRICT", None)
    assert by_env["environment"]["numerics"] == "portable"  # the same switches, set from outside, are recognised
    assert portable["weights"] == by_env["weights"]
    assert portable["sft"] == by_env["sft"] and portable["rl"] == by_env["rl"]
    # and the mode is not a no-op: native kernels round otherwise — on AVX-512 CPUs (ATen's and MKL's own branches)
    # and on AVX2 ones too (MKL's non-strict AVX2 branch: measured on an emulated Haswell)
    native, _ = demo("native", "numerics=native")  # demo.yaml says auto
    assert native["environment"]["numerics"] == "native"
    assert native["weights"]["sft"] != portable["weights"]["sft"]


@pytest.mark.e2e
def test_vlrl_demo_numerics_auto_runs_on_any_cpu_and_says_what_it_chose(demo, tmp_path):
    """`vlrl demo` with demo.yaml's `numerics: auto` runs on every CPU: portable (the same bits as the portable
    mode) on an Intel CPU with AVX2, native (the same bits as the native mode) elsewhere — the choice and its
    reason in the first line of the run and in summary.json. An explicit `numerics=portable` where it cannot take
    effect exits 2 naming the CPU."""
    auto, output = demo("auto")
    chosen = "native" if OBSTACLE is not None else "portable"
    assert f"numerics {chosen}" in output and "chosen by numerics=auto" in output
    env = auto["environment"]
    assert (env["numerics"], env["numerics_requested"]) == (chosen, "auto") and env["cpu_vendor"]
    assert env["numerics_reason"] == (OBSTACLE if OBSTACLE is not None else env["numerics_reason"])
    same, _ = demo(chosen, f"numerics={chosen}")
    assert same["weights"] == auto["weights"]
    if OBSTACLE is not None:
        refused = subprocess.run([sys.executable, "-m", "vlrl.cli", "demo", "--out", str(tmp_path / "p"), *TINY_DEMO,
                                  "numerics=portable"], env=clean_env(), capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and OBSTACLE in refused.stderr


def test_eval_and_serve_take_numerics(tmp_path, tiny_vlm_dir):
    """`vlrl eval` re-evaluates a checkpoint with its run's numerics where this CPU can honour them (a portable run
    on an AMD CPU: native, and the output says why) or with --numerics; `vlrl serve --numerics` pins the server's
    kernels before it loads anything (a bad model path is reported only after the numerics took effect)."""
    import yaml

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "final").symlink_to(tiny_vlm_dir, target_is_directory=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"numerics": "portable", "eval": {"samples": 1,
                                                                                     "max_new_tokens": 2},
                                                     "data": {"n_test": 2}}))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "vlrl.cli", *args], env=clean_env(), capture_output=True,
                              text=True, timeout=300)

    done = cli("eval", "--model", str(run / "checkpoints" / "final"), "--out", str(tmp_path / "e.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    used = json.loads((tmp_path / "e.json").read_text())["settings"]["numerics"]
    assert used["requested"] == "auto"  # the run's portable, where this machine can give it
    assert used["mode"] == ("native" if OBSTACLE else "portable")
    assert used["reason"] == (OBSTACLE or used["reason"])
    explicit = cli("eval", "--model", str(run / "checkpoints" / "final"), "--numerics", "portable", "--out",
                   str(tmp_path / "p.json"))
    if OBSTACLE:
        assert explicit.returncode == 2 and OBSTACLE in explicit.stderr
    else:
        assert explicit.returncode == 0 and json.loads((tmp_path / "p.json").read_text())["settings"]["numerics"][
            "mode"] == "portable"
    assert cli("eval", "--model", str(tiny_vlm_dir), "--numerics", "fast").returncode == 2
    served = cli("serve", "--model", str(tmp_path / "missing"), "--numerics", "portable")
    assert served.returncode == 2
    assert (OBSTACLE in served.stderr) if OBSTACLE else ("--model" in served.stderr)
