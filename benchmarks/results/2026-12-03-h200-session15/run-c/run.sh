#!/usr/bin/env bash
# session 15, call 3: the streamed graph at full width (torch's launch against device launch), graph host at tiny width;
# vram_budget="auto" on a 16 GiB card (1024, 2048); low_ram_safe at 2 and 8 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
(git log -1 --format=%h; git status --short; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc) > $OUT/meta.txt 2>&1
t0=$SECONDS
G=$OUT/graph-host.log
for mode in "--full --budget 16 --calls 10" "--full --budget 16 --calls 10 --device-launch-copies" "--budget min" "--budget resident"; do
  echo "=== graph_host $mode" >> $G
  timeout 90 python -m benchmarks.graph_host $mode > /tmp/gh.log 2>&1; rc=$?; cat /tmp/gh.log >> $G; echo "gh $mode rc $rc at $((SECONDS-t0)) s"
  python - /tmp/gh.log <<'PY'
import json,sys
t=open(sys.argv[1]).read(); d=json.loads(t[:t.index("\n}\n")+2])
print({k: d.get(k) for k in ("host_call_s","host_call_min_s","device_call_s","host_phases_s")}); print(d.get("census"))
PY
done
timeout 220 python -m benchmarks.auto_budget --card 16 --resolutions 1024,2048 --out /tmp/auto > $OUT/auto.log 2>&1; echo "auto rc $? at $((SECONDS-t0)) s"; grep -E "^\|" $OUT/auto.log | tail -3; cat /tmp/auto/*.md >> $OUT/auto.log 2>/dev/null
timeout $((570-SECONDS+t0)) python -m benchmarks.run --routes resident,ours:low_ram_safe --budgets 2,8 --repeats 5 --time-limit $((550-SECONDS+t0)) --no-plot --out /tmp/lrs > $OUT/low-ram.log 2>&1; echo "lrs rc $? at $((SECONDS-t0)) s"; grep "^|" $OUT/low-ram.log | tail -4; cp /tmp/lrs/results.json $OUT/low-ram.json
