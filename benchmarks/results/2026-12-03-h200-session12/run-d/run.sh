#!/usr/bin/env bash
# session 12, call D: is tiered's step at min bimodal per attach (run-b/c: 0.299 or 0.318 s), and does a 64-buffer landing ring remove the slow mode?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 300 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:tiered,min:tiered:64,min:tiered,min:tiered:64,min:tiered,min:tiered:64 --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -9
