#!/usr/bin/env bash
# session 11, call A: GPU tests of the nvme codec and the decode rate under load; codec rows min/4/8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
timeout 150 python -m pytest -q -s -m gpu tests/test_nvme_codec.py tests/test_decode_rate.py tests/test_gpu_codec.py tests/test_nvme.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; grep -i "rate\|passed\|failed\|error" $OUT/gpu-tests.log | tail -12
timeout 380 python -m benchmarks.codec_sweep --rows min:off,min:fixed,min:lossless,4:off,4:lossless,8:off,8:fixed,8:lossless --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -16
