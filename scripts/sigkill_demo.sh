#!/usr/bin/env bash
# A 2-rank torchrun FSDP2 training on CPU that checkpoints with fastckpt, is
# killed with SIGKILL mid-run, resumes from the newest committed checkpoint, and is compared
# step by step with an uninterrupted run of the same job.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "[demo] setting up .venv (torch, fastckpt, the native I/O extension; a few minutes the first time)"
fi
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT:-demo-out}
STEPS=${STEPS:-60}
KILL_AT=${KILL_AT:-35}
export OMP_NUM_THREADS=1  # one thread per rank (and no torchrun warning about it)
rm -rf "$OUT"; mkdir -p "$OUT"
run() {  # run ROOT LOG: the training job on 2 ranks (torchrun's own chatter to OUT/*.torchrun)
  torchrun --standalone --nproc-per-node 2 examples/train_demo.py --root "$1" --loss-log "$2" \
    --steps "$STEPS" --save-every 10 2>>"$2.torchrun"
}
logged() { if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }

echo "== 1. reference: $STEPS steps without interruption"
run "$OUT/ref-ckpt" "$OUT/ref.jsonl"

echo "== 2. the same job, killed with SIGKILL once it has logged $KILL_AT steps"
# started in a session of its own, outside this shell's job table (so the kill is not
# reported as a job "Killed"): the whole session is killed at once below
(setsid bash -c "$(declare -f run); STEPS=$STEPS; run '$OUT/ckpt' '$OUT/run.jsonl'" \
  >"$OUT/run.stdout" 2>&1 & echo $! > "$OUT/job.pid")
job=$(cat "$OUT/job.pid")
while [ "$(logged "$OUT/run.jsonl")" -lt "$KILL_AT" ]; do
  kill -0 "$job" 2>/dev/null || { echo "[demo] the job ended before the kill"; exit 1; }
  sleep 0.1
done
# SIGKILL the whole job: torchrun's session, and the workers, which torchrun starts in
# sessions of their own
kill -KILL -- -"$job" 2>/dev/null || true
pkill -KILL -f "train_demo.py --root $OUT/ckpt " || true
while pgrep -f "train_demo.py --root $OUT/ckpt " >/dev/null || kill -0 "$job" 2>/dev/null; do
  sleep 0.1
done
cat "$OUT/run.stdout"
echo "[demo] SIGKILLed after $(logged "$OUT/run.jsonl") logged steps; what survived:"
fastckpt ls "$OUT/ckpt"

echo "== 3. resume: the same command again"
run "$OUT/ckpt" "$OUT/run.jsonl"

echo "== 4. compare with the uninterrupted run"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
ref = {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/ref.jsonl"))}
rows = [json.loads(l) for l in open(f"{out}/run.jsonl")]
# the resumed incarnation re-logs the steps after its checkpoint: keep the last value of each
run = {}
for r in rows:
    run[r["step"]] = r["loss"]
redone = len(rows) - len(run)
same = all(run[s] == ref[s] for s in ref)
print(f"[demo] steps logged: {len(rows)} ({redone} re-run after the kill); "
      f"losses identical to the uninterrupted run at all {len(ref)} steps: {same}")
print(f"[demo] final loss {run[max(run)]:.6f} (reference {ref[max(ref)]:.6f})")
sys.exit(0 if same and len(run) == len(ref) else 1)
PY
