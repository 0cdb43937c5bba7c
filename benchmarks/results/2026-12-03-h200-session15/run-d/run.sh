#!/usr/bin/env bash
# session 15, call 4: graph host time, synchronized and back to back, at tiny width (min, resident) and full width (16 GiB)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
(git log -1 --format=%h; git status --short; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc) > $OUT/meta.txt 2>&1
t0=$SECONDS
# (GPU tests skipped: the graph code is run-b's, tested there)
G=$OUT/graph-host.log
for mode in "--budget min" "--full --budget 16 --calls 10"; do
  echo "=== graph_host $mode" >> $G
  timeout 90 python -m benchmarks.graph_host $mode > /tmp/gh.log 2>&1; rc=$?; cat /tmp/gh.log >> $G; echo "gh $mode rc $rc at $((SECONDS-t0)) s"
  python - /tmp/gh.log <<'PY'
import json,sys
t=open(sys.argv[1]).read(); d=json.loads(t[:t.index("\n}\n")+2])
print({k: d.get(k) for k in ("host_call_s","host_call_min_s","device_call_s","host_phases_s","back_to_back")})
PY
done
