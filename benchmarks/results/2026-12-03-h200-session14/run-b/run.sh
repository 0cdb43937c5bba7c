#!/usr/bin/env bash
# session 14, call B: copy rate beside GEMMs/attention, encoder rates on the host, the 8 GiB uncompressed profile
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt
t0=$SECONDS
timeout 120 python -m benchmarks.h2d_rate --out $OUT > $OUT/h2d.log 2>&1; echo "h2d rc $? at $((SECONDS-t0)) s"; grep -A14 gb_per_s $OUT/h2d.log
timeout 150 python -m benchmarks.encode_rate --units 8 --out $OUT > $OUT/encode.log 2>&1; echo "encode rc $? at $((SECONDS-t0)) s"; grep -A14 gb_per_s $OUT/encode.log
timeout 150 python -m benchmarks.profile --budget 8GiB --codec off --steps 2 --out /tmp/prof > $OUT/profile-off.log 2>&1; echo "profile rc $? at $((SECONDS-t0)) s"; tail -3 $OUT/profile-off.log
cp /tmp/prof/profile.json $OUT/profile-off.json; python .gpu/extract.py /tmp/prof/trace.json $OUT/lanes-off.json.gz
