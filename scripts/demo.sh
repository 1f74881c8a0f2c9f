#!/usr/bin/env bash
# The main job: the preemption drill. A real 2-rank training job (gloo on CPU) is stopped in
# each scenario (SIGTERM to one rank, to every rank staggered, a peer SIGKILLed mid-save, a
# grace window too short for the state); every rank's signal, consensus, save, commit and exit
# is measured against the window, and each restart is compared bit-exact with an uninterrupted
# run. Prints a pass/fail matrix; writes OUT/drill.json and OUT/drill.png (a timeline).
# Options after the script name go to `fastckpt drill` (e.g. --ranks 4 --size 256MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "[demo] setting up .venv (torch, fastckpt, the native I/O extension; a few minutes the first time)"
fi
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
OUT=${OUT:-demo-out}
# (no rm -rf: the drill reuses its own earlier output and refuses any other non-empty
# directory, so OUT=<a directory of yours> deletes nothing)
exec fastckpt drill "$OUT" "$@"
