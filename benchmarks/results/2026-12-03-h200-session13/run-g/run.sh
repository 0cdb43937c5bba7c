#!/usr/bin/env bash
# session 13, call G: the Huffman kernel with one decoding pass (a scratch per thread), the GPU tests
# with a two-exponent case; huffman and lossless rows at min, 4 and 8 GiB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log -1 --format=%h > $OUT/commit.txt 2>/dev/null; git status --short > $OUT/status.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 150 python -m pytest -q -s -m gpu tests/test_gpu_codec.py tests/test_decode_rate.py > $OUT/gpu-tests.log 2>&1; echo "tests rc $? at $((SECONDS-t0)) s"; grep -E "passed|failed|GB/s|^FAILED" $OUT/gpu-tests.log | tail -8
timeout 300 python -m benchmarks.codec_sweep --no-decode-in-model --rows min:off,min:huffman,min:lossless,4:off,4:lossless,8:off,8:huffman,8:lossless --repeats 5 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $? at $((SECONDS-t0)) s"; grep -v '^{' $OUT/sweep.log | tail -11
python - <<'PY' 2>/dev/null
import json,os
for l in open(os.environ["OUT"]+"/sweep.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["budget"], r["codec"], r.get("chosen_codec"), r.get("decode_gb_s"), r.get("ratio"), (r.get("lossless") or {}).get("replan"), r.get("error"))
PY
