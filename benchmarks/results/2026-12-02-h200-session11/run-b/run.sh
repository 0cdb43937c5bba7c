#!/usr/bin/env bash
# session 11, call B: the nvme codec GPU tests; re-planned coded rows at 4 and 8 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
timeout 100 python -m pytest -q -s -m gpu tests/test_nvme_codec.py tests/test_nvme.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 300 python -m benchmarks.codec_sweep --rows 4:fixed,4:tiered:0:replan,4:fixed:0:replan,8:tiered:0:replan,8:fixed:0:replan --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -10
