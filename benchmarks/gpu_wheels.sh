#!/usr/bin/env bash
# The Python packages benchmarks/gpu_check.py needs that the lent GPU machine's image lacks, gathered as wheels into
# .whl/ (git-ignored) for the `device` tool to carry. The image has torch 2.11 + CUDA 13, transformers 5.17, peft,
# accelerate, numpy, pillow, pyyaml, jinja2, rich, typer, httpx, safetensors, tokenizers (KINDS.md), not pydantic —
# which vlrl.config needs. RapidFuzz and Pebble are vlrl dependencies too (rewards, the reward pool): small, and a
# `vlrl rl` run on the device imports them. transformers: the image's 5.17 lacks what vlrl's pin (5.24) gives — a
# boolean `logits_to_keep` mask, which every update's packed/grouped forward passes (the first device run, 2026-11-28:
# "IndexError: too many indices for tensor of dimension 3" in the head) — so the pinned release travels too (pure
# Python; the image's huggingface_hub 1.33 and tokenizers 0.23.2 satisfy it). Versions: this project's venv's.
# Python 3.12 there (cp312 wheels). fastapi, starlette, uvicorn (and fastapi's annotated-doc and opentelemetry-api):
# `vlrl serve`, which benchmarks/gpu_weight_sync.py starts on the GPU (the image has none of them; it has their other
# dependencies — anyio, h11, click — through httpx and typer).
#
#     bash benchmarks/gpu_wheels.sh        # then carry ".whl" in the `run` call (docs/gpu.md has the command)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  rapidfuzz==3.14.6
  pebble==5.2.3
  transformers==5.24.0
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  annotated-doc==0.0.7
  opentelemetry-api==1.45.2
)
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -la .whl
du -sh .whl
