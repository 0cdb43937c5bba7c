#!/usr/bin/env bash
# session 10, call 3: every GPU test; lossless rows (the shapes fix, the asymmetric re-plan) at 1024 and 2048
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
cp /tmp/site/ddo_blocks/_native*.so ddo_blocks/
git log --oneline -1 > $OUT/commit.txt; git status --short >> $OUT/commit.txt
python -c "import ddo_blocks, inspect; from ddo_blocks.streaming import coded; print(ddo_blocks.__file__, 'shapes' in inspect.getsource(coded.measured_variants))"
timeout 100 python -m pytest -q -m gpu tests > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $OUT/gpu-tests.log
timeout 470 python -m benchmarks.codec_sweep --rows min:off,min:tiered,min:lossless,8:off,8:lossless,16:off,16:lossless,min@2048:off,min@2048:lossless,8@2048:off,8@2048:lossless --repeats 6 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc $?"; grep -v '^{' $OUT/sweep.log | tail -16
