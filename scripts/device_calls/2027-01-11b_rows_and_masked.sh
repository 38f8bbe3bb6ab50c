#!/usr/bin/env bash
# One call for a session with ~10 minutes of device time: queue item 0's short form (the 1b rows bf16 / w4a4+rac50 /
# w4a4 on the committed defaults, 2027-01-09c_rac_rows_short.sh) and then the masked-rows probe on the current tree
# and the tree before (2027-01-11_masked_rows.sh without its tests). One GPU, <= 580 s (TOTAL=<s>;
# run 81 ran it with 300 s for the rows, which cut the third recipe: each cold compile takes ~118 s).
# OUT=$OUT TOTAL=575 bash scripts/device_calls/2027-01-11b_rows_and_masked.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
E2E="benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 --long-tokens 0 --graphs on --compile on"
timeout $(cap 390) python3 -u $E2E --recipes bf16,w4a4+rac50,w4a4 --json $OUT/e2e_1b.json > $OUT/e2e_1b.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_1b.log
P=scripts/device_calls/masked_rows_probe.py
timeout $(cap 130) python3 -u $P --label now > $OUT/masked_now.jsonl 2> $OUT/masked_now.err; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/masked_now.err
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r quads benchmarks scripts /tmp/before/ \
  && (cd /tmp/before && patch -R -p1 < $OLDPWD/scripts/device_calls/2027-01-11_no_group_zero_rows.patch > $OUT/patch.log 2>&1)
(cd /tmp/before && TORCHINDUCTOR_CACHE_DIR=/tmp/before/cache/inductor TRITON_CACHE_DIR=/tmp/before/cache/triton \
  TORCH_EXTENSIONS_DIR=/tmp/before/ext PYTHONPATH=/tmp/before timeout $(cap 130) python3 -u $P --label before \
  > $OUT/masked_before.jsonl 2> $OUT/masked_before.err; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/masked_before.err)
cat $OUT/gpu.txt; grep -h "rc=\|x bf16\|ms/step" $OUT/e2e_1b.log | tail -n 8
cat $OUT/masked_now.jsonl $OUT/masked_before.jsonl; tail -n 2 $OUT/masked_*.err
true
