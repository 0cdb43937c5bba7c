#!/usr/bin/env bash
# session 12, call A: GPU tests of the commits not yet run on a GPU; setup of fixed vs off (fused encoder); lossless at min
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 200 python -m pytest -q -s -m gpu tests/test_nvme_codec.py tests/test_gpu_codec.py tests/test_nvme.py tests/test_decode_rate.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 360 python -m benchmarks.codec_sweep --rows min:off,min:fixed,min:lossless,8:off,8:fixed,8:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -10
