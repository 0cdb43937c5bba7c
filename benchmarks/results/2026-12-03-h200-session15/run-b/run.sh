#!/usr/bin/env bash
# session 15, call 2: graph inputs as one dtype, host phases, census, device launch with copies (tiny width);
# graph steps at 512 / 1024 and 16 GiB; the codec at 2048x2048, 8 GiB (the compute-heavy case)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 60 python -m pytest -q -s -m gpu tests/test_gpu_graph.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu-tests.log | tail -6
for mode in "min" "min --device-launch-copies" "resident"; do
  name=$(echo $mode | tr ' ' '_' | tr -d '-')
  timeout 45 python -m benchmarks.graph_host --budget $mode > $OUT/gh-$name.log 2>&1; echo "gh $mode rc $? at $((SECONDS-t0)) s"
  python - $OUT/gh-$name.log <<'PY'
import json,sys
t=open(sys.argv[1]).read(); d=json.loads(t[:t.index("\n}\n")+2])
print({k: d.get(k) for k in ("host_call_s","host_call_min_s","device_call_s","host_phases_s")}); print(d.get("census")); print(d["graph"]["device_launch"])
PY
done
timeout 150 python -m benchmarks.run --routes ours:one_shot_fast,ours:one_shot_fast+graph,ours:one_shot_fast+graph@24 --budgets 16 --resolution 512 --repeats 5 --time-limit 140 --no-plot --out /tmp/b512 > $OUT/bench-512.log 2>&1; echo "b512 rc $? at $((SECONDS-t0)) s"; grep "^|" $OUT/bench-512.log | tail -4; cp /tmp/b512/results.json $OUT/bench-512.json
timeout 120 python -m benchmarks.run --routes ours:one_shot_fast,ours:one_shot_fast+graph --budgets 16 --resolution 1024 --repeats 5 --time-limit 110 --no-plot --out /tmp/b1024 > $OUT/bench-1024.log 2>&1; echo "b1024 rc $? at $((SECONDS-t0)) s"; grep "^|" $OUT/bench-1024.log | tail -3; cp /tmp/b1024/results.json $OUT/bench-1024.json
timeout $((580-SECONDS+t0)) python -m benchmarks.codec_sweep --no-decode-in-model --resolution 2048 --rows 8:off,8:lossless --repeats 3 --out /tmp/sweep > $OUT/sweep-2048.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep-2048.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], r.get("chosen_codec"), "step", round(r["step_s"],4), "per_bound", round(r.get("step_per_bound") or 0,3), "per_roof", round(r.get("step_per_roofline") or 0,3), "exact", r.get("exact"), "setup", round(r["setup_s"],2), (r.get("lossless") or {}).get("replan"))
PY
