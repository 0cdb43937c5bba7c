#!/usr/bin/env bash
# session 9, call 2: raw pieces through the landing ring + the 34-buffer ring (d966735)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
timeout 120 python -m pytest -q -m gpu tests/test_gpu_codec.py -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/gpu-tests.log
timeout 420 python -m benchmarks.codec_sweep --budgets min,4,8,16 --codecs off,fixed,tiered --rings 0 --repeats 4 --out $OUT/sweep 2>&1 | tee $OUT/sweep.log | grep -v '^{'
