#!/usr/bin/env bash
# session 9, call 3: every GPU test at the ring change; ring 64 against the default; re-planned coded rows at 16 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
timeout 150 python -m pytest -q -m gpu tests -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/gpu-tests.log
timeout 400 python -m benchmarks.codec_sweep --rows min:off,min:tiered:64,8:off,8:fixed:0,8:fixed:64,8:tiered:0,8:tiered:64,4:off,4:fixed:64,4:tiered:64,16:off,16:fixed:0:replan,16:tiered:0:replan --repeats 4 --out $OUT/sweep 2>&1 | tee $OUT/sweep.log | grep -v '^{'
