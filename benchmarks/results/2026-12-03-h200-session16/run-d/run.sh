#!/usr/bin/env bash
# session 16, call D: why the linear row on a 10 GiB card was not exact (.gpu/diag.py, copied here as diag.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
(git log -1 --format=%h; git status --short; date -u) > $OUT/meta.txt 2>&1
timeout 200 python .gpu/diag.py  # this folder's diag.py > $OUT/log.txt 2>&1; echo "rc $?" >> $OUT/log.txt
