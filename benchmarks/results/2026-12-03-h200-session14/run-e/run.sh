#!/usr/bin/env bash
# session 14, call E: the coded buffers in one host reservation; the link-heavy fill with measured compute only;
# the encoder as before: codec GPU tests; min off/fixed (setup), 8 GiB fixed and lossless
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt
t0=$SECONDS
timeout 55 python -m pytest -q -s -m gpu tests/test_gpu_codec.py -x > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|^FAILED" $OUT/gpu-tests.log | tail -4
timeout $((215-SECONDS+t0)) python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,8:fixed,8:lossless --repeats 2 --out /tmp/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], r.get("chosen_codec"), "step", round(r["step_s"],4), "per_bound", round(r.get("step_per_bound") or 0,3), "per_roof", round(r.get("step_per_roofline") or 0,3), "exact", r.get("exact"), "setup", round(r["setup_s"],2), {k: round(v, 2) for k, v in (r.get("setup_phases") or {}).items() if v})
PY
