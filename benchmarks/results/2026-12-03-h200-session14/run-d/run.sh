#!/usr/bin/env bash
# session 14, call D: the planner's link-heavy fill: codec GPU tests, lossless rows at min, 4 and 8 GiB, fixed and off at 8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt
t0=$SECONDS
timeout 120 python -m pytest -q -s -m gpu tests/test_gpu_codec.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|^FAILED" $OUT/gpu-tests.log | tail -4
timeout 400 python -m benchmarks.codec_sweep --no-decode-in-model --rows 8:off,8:lossless,8:fixed,4:off,4:lossless,min:off,min:lossless --repeats 3 --out /tmp/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], r.get("chosen_codec"), "step", round(r["step_s"],4), "pred", round(r.get("predicted_step_s") or 0,4), "bound", round(r.get("bound_s") or 0,4), "per_bound", round(r.get("step_per_bound") or 0,3), "per_roof", round(r.get("step_per_roofline") or 0,3), "slots", r.get("slots"), "exact", r.get("exact"), "setup", round(r["setup_s"],2), r.get("error"))
PY
