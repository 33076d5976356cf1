#!/usr/bin/env bash
# Regenerate docs/report-demo.png: a short demo run, its report.html, and the first screen in headless Chromium
# (Debian: `apt-get install chromium`). Usage: bash docs/screenshot.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-/tmp/vlrl-screenshot-demo}"
if [ ! -f "$RUN/report.html" ]; then
  vlrl demo --out "$RUN" sft.train.steps=300 rl.train.steps=30 control=false sft.train.log_every=10 rl.train.log_every=1
fi
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
  --screenshot="$PWD/docs/report-demo.png" "file://$(realpath "$RUN/report.html")"
