#!/usr/bin/env bash
# session 14, call C: copy rate by host page size and scatter; the 8 GiB lossless profile with coded buffers
# on 2 MiB pages; the fixed encoder (block codes through a buffer, AVX2 dispatch) and its setup rows
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git diff --stat > $OUT/status.txt
t0=$SECONDS
timeout 100 python -m benchmarks.h2d_rate --out $OUT > $OUT/h2d.log 2>&1; echo "h2d rc $? at $((SECONDS-t0)) s"; grep -A20 transparent $OUT/h2d.log | tr -d '\n '; echo
timeout 60 python -m benchmarks.encode_rate --units 8 --codecs fixed --out $OUT > $OUT/encode.log 2>&1; echo "encode rc $? at $((SECONDS-t0)) s"; grep -A8 gb_per_s $OUT/encode.log | tr -d '\n '; echo
(sleep 70; grep -i huge /proc/meminfo > $OUT/meminfo-huge.txt) &
DDO_HOST_HUGEPAGES=1 timeout 150 python -m benchmarks.profile --budget 8GiB --codec lossless --warmup 3 --steps 2 --out /tmp/prof > $OUT/profile-huge.log 2>&1; echo "profile rc $? at $((SECONDS-t0)) s"; tail -3 $OUT/profile-huge.log
cp /tmp/prof/profile.json $OUT/profile-huge.json; python .gpu/extract.py /tmp/prof/trace.json $OUT/lanes-huge.json.gz; cat $OUT/meminfo-huge.txt
timeout 170 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,8:off,8:fixed --repeats 2 --out /tmp/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], "step", round(r["step_s"],4), "setup", round(r["setup_s"],2), {k: round(v, 3) for k, v in (r.get("setup_phases") or {}).items() if v}, r.get("error"))
PY
