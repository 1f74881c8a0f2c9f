#!/usr/bin/env bash
# The main job: a 2-rank torchrun FSDP2 training on CPU that checkpoints with fastckpt, is
# killed with SIGKILL mid-run, resumes from the newest committed checkpoint, and is compared
# step by step with an uninterrupted run of the same job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT:-demo-out}
STEPS=${STEPS:-60}
rm -rf "$OUT"; mkdir -p "$OUT"
run() {  # run ROOT LOG: the training job on 2 ranks
  torchrun --standalone --nproc-per-node 2 examples/train_demo.py --root "$1" --loss-log "$2" \
    --steps "$STEPS" --save-every 10
}

echo "== 1. reference: $STEPS steps without interruption"
run "$OUT/ref-ckpt" "$OUT/ref.jsonl"

echo "== 2. the same job, killed with SIGKILL after step 35"
setsid bash -c "$(declare -f run); STEPS=$STEPS; run '$OUT/ckpt' '$OUT/run.jsonl'" &
job=$!
while [ "$(wc -l < "$OUT/run.jsonl" 2>/dev/null || echo 0)" -lt 35 ]; do sleep 0.1; done
# SIGKILL the whole job at once: torchrun's process group, and the workers, which torchrun
# starts in sessions of their own
pkill -KILL -f "train_demo.py --root $OUT/ckpt " || true
kill -KILL -- -"$job" 2>/dev/null || true
wait "$job" 2>/dev/null || true
while pgrep -f "train_demo.py --root $OUT/ckpt " >/dev/null; do sleep 0.1; done
echo "[demo] killed after $(wc -l < "$OUT/run.jsonl") logged steps"
fastckpt ls "$OUT/ckpt" 2>/dev/null || python -c "import fastckpt; print('[demo] newest committed step:', fastckpt.Checkpointer('$OUT/ckpt').latest_step())"

echo "== 3. resume"
run "$OUT/ckpt" "$OUT/run.jsonl"

echo "== 4. compare"
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
