#!/usr/bin/env bash
# session 10, call 4: the parallel host decode (remove), lossless after the review fixes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
timeout 60 python -m pytest -q -m gpu tests/test_gpu_codec.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -2 $OUT/gpu-tests.log
timeout 250 python -m benchmarks.codec_sweep --rows min:off,min:lossless,8:off,8:fixed,8:lossless --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -12
