#!/usr/bin/env bash
# session 12, call C: fixed's setup with the decode rate measured while coding (81f7222); lossless at min twice (run-b's min row was 6% slower than run-a's); a 64-buffer ring for tiered at 8 GiB; lossless at 2048x2048
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 90 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_decode_rate.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 420 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,min:lossless,min:lossless,8:off,8:fixed,8:lossless,8:tiered:64:replan,8@2048:off,8@2048:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -14
