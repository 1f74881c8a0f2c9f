#!/usr/bin/env bash
# Create .venv and install fastckpt with its test dependencies (idempotent).
# torch is pinned to the CPU build that installs from local disk here; on a machine with a
# GPU install the torch you need first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=""
  [ -f /usr/include/xxhash.h ] || missing="$missing libxxhash-dev"
  command -v fio >/dev/null || missing="$missing fio"
  if [ -n "$missing" ]; then
    echo "[setup] apt-get install$missing"
    (apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 ||
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1)) ||
      echo "[setup] could not install$missing: the native I/O path or fio benchmarks may be unavailable"
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >.venv/pip-upgrade.log 2>&1 || cat .venv/pip-upgrade.log
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
mkdir -p .venv/log
# the integrations' packages must not replace the torch installed above
python -c "import torch; print('torch==' + torch.__version__)" >.venv/log/constraints.txt
python -m pip install -q -c .venv/log/constraints.txt -e ".[test]" >.venv/log/pip-install.log 2>&1 || {
  cat .venv/log/pip-install.log; echo "[setup] pip install failed"; exit 1; }
python -c "import fastckpt, fastckpt.storage.native as n; print('[setup] fastckpt', fastckpt.__version__, '| I/O backend:', 'native' if n.native_available() else 'python (' + str(n.native_error()) + ')')"
