#!/usr/bin/env bash
# session 13, call F: the Huffman code (kernel bit for bit, offloads exact inside the budget, its
# decode rate), the decode-rate probe's cuBLAS workspace freed; huffman rows at min and 8 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 200 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_decode_rate.py tests/test_nvme_codec.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|GB/s" $OUT/gpu-tests.log | tail -8
timeout 330 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:fixed,min:tiered,min:huffman,min:huffman,8:off,8:huffman,8:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"; grep -v '^{' $OUT/sweep.log | tail -11
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], r.get("chosen_codec"), r.get("streams"), r.get("decode_gb_s"), r.get("ratio"), r.get("error"))
PY
