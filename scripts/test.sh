#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. CI runs exactly this.
# The suite runs once with the native I/O extension required (when it built), then the
# storage, staging (CPU and simulated CUDA), fault and crash tests run again on the pure-Python I/O path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if python -c "import fastckpt.storage.native as n, sys; sys.exit(0 if n.native_available() else 1)"; then
  native=require
else
  native=off
  echo "[test] the native extension is not built: the whole suite runs on the Python I/O path"
fi
echo "[test] full suite, FASTCKPT_NATIVE=$native"
FASTCKPT_NATIVE=$native python -m pytest -q -p no:cacheprovider --durations=30 "$@"
if [ "$native" = require ] && [ $# -eq 0 ]; then
  echo "[test] I/O-path tests again, FASTCKPT_NATIVE=off"
  FASTCKPT_NATIVE=off python -m pytest -q -p no:cacheprovider tests/test_faults.py \
    tests/test_staging.py tests/test_device_staging.py tests/test_crash.py -k "not random_times"
fi
if [ $# -eq 0 ]; then
  # the default indexes saves of 16 ranks and more only: run the multi-rank, multi-node,
  # tiered-preemption and CLI tests again with per-rank chunk indexes on every save (format 4)
  echo "[test] multi-rank tests again, FASTCKPT_RANK_INDEXES=1 (per-rank chunk indexes)"
  # (not the CLI's benches: their saves are the engine's, run in the full pass)
  FASTCKPT_RANK_INDEXES=1 FASTCKPT_NATIVE=$native python -m pytest -q -p no:cacheprovider \
    tests/test_distributed.py tests/test_cli.py tests/test_multinode.py tests/test_tiered_preempt.py \
    -k "not bench"
fi
