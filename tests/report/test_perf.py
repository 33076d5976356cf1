"""MFU: the peak table, the measured CPU peak, and the phase arithmetic (`vlrl.report.perf`)."""

import time

import pytest
import torch

from vlrl.report.perf import Peak, device_peak, gpu_peak, measured_cpu_peak, phase_metrics


@pytest.mark.parametrize("name, dtype, tf32, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12),  # SXM5, dense bf16
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),  # not the SXM number: "h100 pcie" is matched first
    ("NVIDIA H200", torch.bfloat16, False, 989e12),
    ("NVIDIA A100-SXM4-80GB", torch.float16, False, 312e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5e12),  # plain fp32 without TF32
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156e12),
    ("NVIDIA L40S", torch.bfloat16, False, 362e12),  # not L40's 181, not L4's 121
    ("NVIDIA L4", torch.bfloat16, False, 121e12),
    ("Some Future GPU", torch.bfloat16, False, 0.0),
])
def test_gpu_peaks_from_the_datasheet_table(name, dtype, tf32, expected):
    assert gpu_peak(name, dtype, tf32=tf32) == expected


def test_the_cpu_peak_is_measured_once_per_process_and_thread_count():
    first = measured_cpu_peak(torch.float32, 1)
    start = time.perf_counter()
    again = measured_cpu_peak(torch.float32, 1)
    assert again == first and time.perf_counter() - start < 1e-3  # cached, not re-measured
    # a 2-core machine here runs an fp32 matmul at ~50-100 GFLOP/s per thread; anything between 1 GFLOP/s and
    # 10 TFLOP/s is a plausible CPU, a unit error (FLOP/s vs GFLOP/s) is not
    assert 1e9 < first < 1e13
    peak = device_peak("cpu")
    assert peak.flops >= measured_cpu_peak(torch.float32) and peak.source.startswith("CPU fp32 matmul, best measured")


def test_the_cpu_peak_is_the_best_this_machine_has_shown_not_the_start_ups(tmp_path, monkeypatch):
    """A run that starts under load measures a low rate; it divides by the machine's cached best instead (so
    perf/mfu does not swing with the load at start-up); a better measurement replaces the cached one."""
    import json

    from vlrl.report.perf import _machine_key, cpu_peak

    monkeypatch.setenv("VLRL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLRL_CPU_PEAK_TFLOPS", raising=False)
    measured = measured_cpu_peak(torch.float32, 1)
    key = _machine_key(torch.float32, 1)
    (tmp_path / "cpu_peak.json").write_text(json.dumps({key: 10 * measured}))  # an idle machine's rate, earlier
    assert cpu_peak(torch.float32, 1).flops == 10 * measured  # not this process's (lower) measurement
    (tmp_path / "cpu_peak.json").write_text(json.dumps({key: measured / 10, "another machine": 1.0}))
    assert cpu_peak(torch.float32, 1).flops == measured
    assert json.loads((tmp_path / "cpu_peak.json").read_text()) == {key: measured, "another machine": 1.0}
    (tmp_path / "cpu_peak.json").write_text("not json")  # a broken cache is measured over, not an error
    assert cpu_peak(torch.float32, 1).flops == measured
    monkeypatch.setenv("VLRL_CPU_PEAK_TFLOPS", "0.5")  # a nominal peak, named
    peak = cpu_peak(torch.float32, 1)
    assert peak.flops == 0.5e12 and "VLRL_CPU_PEAK_TFLOPS" in peak.source


def test_phase_metrics_arithmetic():
    # 2e12 FLOPs in 4 s = 0.5 TFLOP/s; of a 2 TFLOP/s peak: 25 %
    assert phase_metrics(2e12, 4.0, Peak(2e12, "test"), prefix="gen_") == {"perf/gen_tflops": 0.5, "perf/gen_mfu": 0.25}
    assert phase_metrics(2e12, 4.0, Peak(0.0, "unknown GPU")) == {"perf/tflops": 0.5}  # no peak: no MFU
    assert phase_metrics(0.0, 4.0, Peak(2e12, "test")) == {}  # nothing ran on the policy (e.g. rollout servers)
