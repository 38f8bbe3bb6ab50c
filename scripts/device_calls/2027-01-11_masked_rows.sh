#!/usr/bin/env bash
# Issue 17: the W4A4 + RAC 50% decode operand when rows have finished (masked slots = the rows of no group), on the
# current tree (the rows of no group are zero rows: no kernel walks them) and on the tree before (a copy with
# 2027-01-11_no_group_zero_rows.patch applied in reverse: RAC's selection walks every masked row in one program).
# scripts/device_calls/masked_rows_probe.py on each, then the GPU tests of the changed kernels on the current tree.
# The patch is `git diff 7ef45b2 -- quads` (7ef45b2: the tree before), so the copy's quads/ is that tree's; regenerate
# it so after any later change under quads/, or when patch.log shows a rejected hunk.
# One GPU, <= 430 s (TOTAL=<s>; the CUDA selection builds twice, ~41 s each). OUT=$OUT TOTAL=430 bash scripts/device_calls/2027-01-11_masked_rows.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
P=scripts/device_calls/masked_rows_probe.py
timeout $(cap 130) python3 -u $P --label now > $OUT/masked_now.jsonl 2> $OUT/masked_now.err; echo "rc=$?" >> $OUT/masked_now.err
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r quads benchmarks scripts /tmp/before/ \
  && (cd /tmp/before && patch -R -p1 < $OLDPWD/scripts/device_calls/2027-01-11_no_group_zero_rows.patch > $OUT/patch.log 2>&1)
(cd /tmp/before && TORCHINDUCTOR_CACHE_DIR=/tmp/before/cache/inductor TRITON_CACHE_DIR=/tmp/before/cache/triton \
  TORCH_EXTENSIONS_DIR=/tmp/before/ext PYTHONPATH=/tmp/before timeout $(cap 130) python3 -u $P --label before > $OUT/masked_before.jsonl 2> $OUT/masked_before.err
  echo "rc=$?" >> $OUT/masked_before.err)
timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -x tests/test_rac_select_cuda.py tests/test_quant_factored_gpu.py \
  > $OUT/gpu_tests.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.log
cat $OUT/gpu.txt; cat $OUT/masked_now.jsonl $OUT/masked_before.jsonl; tail -n 3 $OUT/masked_*.err $OUT/gpu_tests.log
true
