#!/usr/bin/env bash
# session 16, call A (#15): auto with graphs and eager on a 16 GiB card (same host), graph host phases at full width
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
(git log -1 --format=%h; git status --short; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date -u) > $OUT/meta.txt 2>&1
t0=$SECONDS
L=$OUT/log.txt
echo "=== auto_budget --graph" >> $L
timeout 240 python -m benchmarks.auto_budget --card 16 --resolutions 1024,2048 --graph --out /tmp/ag >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/ag/auto_budget.json $OUT/auto-graph.json
echo "=== auto_budget eager" >> $L
timeout 150 python -m benchmarks.auto_budget --card 16 --resolutions 1024 --out /tmp/ae >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/ae/auto_budget.json $OUT/auto-eager.json
echo "=== graph_host --full --budget 16 --calls 10" >> $L
timeout 120 python -m benchmarks.graph_host --full --budget 16 --calls 10 --out /tmp/gh >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/gh/graph_host.json $OUT/graph-host-full.json 2>/dev/null
echo "done at $((SECONDS-t0)) s" >> $L
