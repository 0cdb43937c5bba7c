#!/usr/bin/env bash
# session 14, call A: GPU tests of the codec (incl. NVMe huffman), the 8 GiB lossless profile, fixed setup rows
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 200 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_decode_rate.py tests/test_nvme_codec.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|^FAILED" $OUT/gpu-tests.log | tail -8
timeout 170 python -m benchmarks.profile --budget 8GiB --codec lossless --warmup 3 --steps 2 --out /tmp/prof > $OUT/profile.log 2>&1; echo "profile rc $? at $((SECONDS-t0)) s"; tail -4 $OUT/profile.log
cp /tmp/prof/profile.json /tmp/prof/timeline.png $OUT/ 2>/dev/null; python .gpu/extract.py /tmp/prof/trace.json $OUT/lanes.json.gz
timeout 200 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,8:off,8:fixed --repeats 3 --out /tmp/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], "step", round(r["step_s"],4), "setup", round(r["setup_s"],2), r.get("setup_phases"), r.get("error"))
PY
