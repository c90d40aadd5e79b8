#!/usr/bin/env bash
# Creates .venv (if missing) and installs torch, torchvision and mpfp16 into it.
# Idempotent: a second run only checks that everything is there.
# TORCH_SPEC overrides the torch requirement, e.g. TORCH_SPEC="torch==2.14.1 torchvision==0.29.1".
set -euo pipefail
cd "$(dirname "$0")"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# torch first, pinned, so that nothing later pulls another build.
.venv/bin/python -m pip install -q ${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
.venv/bin/python -m pip install -q -e '.[dev]'
