#!/usr/bin/env bash
# session 16, call C: the refined planner under vram_budget="auto" at 1024x1024 (graph and eager, #15); the pipeline
# on a 10 GiB card (#13): the vmm auto arena against the linear route's static split fitted to the card,
# sequential CPU offload and mmgp in the same run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
(git log -1 --format=%h; git status --short; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date -u) > $OUT/meta.txt 2>&1
t0=$SECONDS
L=$OUT/log.txt
echo "=== auto_budget --graph 1024" >> $L
timeout 130 python -m benchmarks.auto_budget --card 16 --resolutions 1024 --graph --out /tmp/ag >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/ag/auto_budget.json $OUT/auto-graph.json
echo "=== auto_budget eager 1024" >> $L
timeout 110 python -m benchmarks.auto_budget --card 16 --resolutions 1024 --out /tmp/ae >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/ae/auto_budget.json $OUT/auto-eager.json
echo "=== pipeline card 10" >> $L
timeout $((575-SECONDS+t0)) python -m benchmarks.pipeline --card 10 --budgets auto --routes vmm,linear,sequential_cpu_offload,mmgp --steps 28 --generations 3 --out /tmp/p10 >> $L 2>&1; echo "rc $? at $((SECONDS-t0)) s" >> $L
cp /tmp/p10/pipeline.json $OUT/card10.json
echo "done at $((SECONDS-t0)) s" >> $L
