#!/usr/bin/env bash
# The GPU check in one script, for the device machine: build the native extension (xxhash.h
# from .devbuild/ when the machine lacks libxxhash-dev: carry it), the CUDA staging tests, then
# benchmarks/gpu_check.py (about 2-4 min on an H200). Writes logs and gpu_check.json to $OUT.
# Prepare on the build machine: mkdir -p .devbuild; cp /usr/include/xxhash.h .devbuild/;
# git rev-parse HEAD >.devbuild/COMMIT; echo /.devbuild/ >>.git/info/exclude; then run
# `bash benchmarks/gpu_run.sh` there with .devbuild carried (timeout about 480 s).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
date -u; nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
python3 -c "import torch,sys;print('python',sys.version.split()[0],'torch',torch.__version__,torch.cuda.get_device_name(0))"
git rev-parse HEAD 2>/dev/null || echo "commit: $(cat .devbuild/COMMIT 2>/dev/null || echo unknown)"
CFLAGS="-I$PWD/.devbuild" timeout 120 python3 setup.py -q build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$?"; tail -3 $OUT/build.log
python3 -c "import fastckpt.storage.native as n; print('native', n.native_available(), n.native_error())"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_device_staging.py 2>&1 | tee $OUT/staging.log | tail -15
timeout 330 python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
echo "gpu_check rc=${PIPESTATUS[0]}"
