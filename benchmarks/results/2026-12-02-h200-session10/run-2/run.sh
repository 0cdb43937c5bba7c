#!/usr/bin/env bash
# session 10, call 2: codec='lossless' (choice and re-plan), the faster count/encode, GPU codec tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log --oneline -1 > $OUT/commit.txt
timeout 150 python -m pytest -q -m gpu tests/test_gpu_codec.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 420 python -m benchmarks.codec_sweep --rows min:off,min:fixed,min:lossless,8:off,8:fixed,8:lossless,16:off,16:lossless,min@2048:off,min@2048:lossless --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -16
