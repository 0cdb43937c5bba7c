#!/usr/bin/env bash
# session 9, call 1: GPU tests at the session-8 head, the copy rate beside SM traffic, the landing-ring sweep
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null || true
timeout 200 python -m pytest -q -m gpu tests -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "pytest rc $?"; tail -5 $OUT/gpu-tests.log
timeout 90 python -m benchmarks.h2d_rate --out $OUT/h2d > $OUT/h2d.log 2>&1; echo "h2d rc $?"; grep -A8 gb_per_s $OUT/h2d.log
timeout 330 python -m benchmarks.codec_sweep --budgets min,8 --codecs off,fixed,tiered --rings 8,16,32 --repeats 4 --out $OUT/sweep 2>&1 | tee $OUT/sweep.log | tail -22
