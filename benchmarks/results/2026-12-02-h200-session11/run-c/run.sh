#!/usr/bin/env bash
# session 11, call C: the NVMe route with codec=tiered against codec=off (Flux-dev-sized, from disk)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
df -h /tmp > $OUT/df.txt
timeout 560 python -m benchmarks.nvme --device cuda --vram-budgets 8 --ram-budgets 0 --codecs off,tiered,tiered --repeats 2 --no-diffusers --disk-probe-gib 2 --out $OUT/nvme > $OUT/nvme.log 2>&1; echo "nvme rc $?"; grep -v '^{' $OUT/nvme.log | grep -v "^|" | tail -12; cat $OUT/nvme/nvme.md 2>/dev/null | grep "^|"
ls -la /tmp/ddo-loading-model >> $OUT/df.txt; df -h /tmp >> $OUT/df.txt
