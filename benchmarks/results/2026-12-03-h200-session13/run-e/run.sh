#!/usr/bin/env bash
# session 13, call E: the turning ring's GPU tests (ecec833, 065c0f2); tiered's two speeds at min
# against stream ids and CUDA_DEVICE_MAX_CONNECTIONS; 8 GiB with the turning ring; graph host time
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 150 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_nvme_codec.py tests/test_decode_rate.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; tail -3 $OUT/gpu-tests.log
timeout 230 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:tiered,min:tiered,min:tiered,min:tiered,8:off,8:fixed,8:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"; grep -v '^{' $OUT/sweep.log | tail -11
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 140 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:tiered,min:tiered,min:tiered,min:tiered --repeats 5 --out $OUT/sweep32 > $OUT/sweep32.log 2>&1; echo "sweep32 rc $? at $((SECONDS-t0)) s"; grep -v '^{' $OUT/sweep32.log | tail -6
for b in min resident; do timeout 40 python -m benchmarks.graph_host --budget $b --out $OUT/graph-host-$b > $OUT/graph-host-$b.log 2>&1; echo "graph_host $b rc $? at $((SECONDS-t0)) s"; head -c 600 $OUT/graph-host-$b/graph_host.txt 2>/dev/null; done
