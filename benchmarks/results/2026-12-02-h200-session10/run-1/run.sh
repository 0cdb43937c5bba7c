#!/usr/bin/env bash
# session 10, call 1: the coded copy rate probed, setup phases and the measured re-plan at 8 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log --oneline -1 > $OUT/commit.txt; nvidia-smi > $OUT/gpu.txt 2>&1; lscpu > $OUT/lscpu.txt; (numactl -H || cat /sys/devices/system/node/online) > $OUT/numa.txt 2>&1
cat /sys/kernel/mm/transparent_hugepage/enabled >> $OUT/numa.txt
timeout 100 python -m benchmarks.h2d_rate --out $OUT/h2d > $OUT/h2d.log 2>&1; echo "h2d rc $?"; tail -20 $OUT/h2d.log
timeout 420 python -m benchmarks.codec_sweep --rows min:off,min:fixed,8:off,8:fixed:0:replan,8:tiered:0:replan --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; tail -30 $OUT/sweep.log
