#!/usr/bin/env bash
# session 12, call B: the GPU tests after ab8e451/580f064; codec rows with lossless's same-coding re-plan and the decode timed in the model
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 120 python -m pytest -q -s -m gpu tests/test_nvme_codec.py tests/test_gpu_codec.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 420 python -m benchmarks.codec_sweep --rows min:off,min:lossless,4:off,4:lossless,8:off,8:fixed,8:fixed:0:replan,8:lossless,8:tiered:0:replan,8@2048:off,8@2048:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -14
