#!/usr/bin/env bash
# session 9, call 4: profiles of coded steps at 8 GiB with the default ring (37d8940, Rust of d966735)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
for c in tiered; do
  timeout 140 python -m benchmarks.profile --budget 8GiB --codec $c --steps 2 --out $OUT/prof-$c > $OUT/prof-$c.log 2>&1; echo "profile $c rc $?"
  rm -f $OUT/prof-$c/trace.json; tail -4 $OUT/prof-$c.log
done
