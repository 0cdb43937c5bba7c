#!/usr/bin/env bash
# session 15, call 1: the one-pass fixed encoder on the GPU host (setup off vs fixed, encode_rate),
# codec and graph GPU tests, graph host time at min and resident
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
t0=$SECONDS
timeout 120 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_gpu_graph.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|^FAILED" $OUT/gpu-tests.log | tail -6
timeout 60 python -m benchmarks.encode_rate --codecs fixed --out /tmp/enc > $OUT/encode.log 2>&1; echo "encode rc $? at $((SECONDS-t0)) s"; tail -12 $OUT/encode.log
timeout 300 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,8:off,8:fixed,min:off,min:fixed --repeats 3 --out /tmp/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], "step", round(r["step_s"],4), "per_bound", round(r.get("step_per_bound") or 0,3), "per_roof", round(r.get("step_per_roofline") or 0,3), "exact", r.get("exact"), "setup", round(r["setup_s"],2), {k: round(v, 2) for k, v in (r.get("setup_phases") or {}).items() if v})
PY
timeout 60 python -m benchmarks.graph_host --budget min --out /tmp/gh-min > $OUT/graph-host-min.log 2>&1; echo "gh min rc $? at $((SECONDS-t0)) s"; grep -E '"host_call_s"|"host_launch_s"|"host_replay_s"' $OUT/graph-host-min.log
timeout 60 python -m benchmarks.graph_host --budget resident --out /tmp/gh-res > $OUT/graph-host-resident.log 2>&1; echo "gh res rc $? at $((SECONDS-t0)) s"; grep -E '"host_call_s"|"host_launch_s"|"host_replay_s"' $OUT/graph-host-resident.log
