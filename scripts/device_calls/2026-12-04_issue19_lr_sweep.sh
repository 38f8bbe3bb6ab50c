#!/usr/bin/env bash
# Issue 19's BF16 learning-rate sweep on the chain without outliers (configs/chain_100m.yaml: lr 5e-6 with a
# 10-step warmup, no IS correction, two mini-batches), the plan item the 5e-6 runs skipped: BF16 at lr 2e-6,
# 1e-5 and 2e-5 (the config's warmup for all; 2e-5 without warmup ran on 2026-12-01), seeds 0 and 1, six runs on
# one H200 from one warm start, 150 steps over two or three calls on the same warm machine. The 5e-6 point is
# the committed three seeds (other warm starts: the GPU SFT is not bit-reproducible across machines).
# First call: OUT=$OUT bash scripts/device_calls/2026-12-04_issue19_lr_sweep.sh; next: CONTINUE=1 BUDGET_S=... bash ...
# Land: python scripts/collapse_report.py land results/gpu/collapse/<tag> <call 1>/results.tar.gz [<call 2>/...]
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1
CONFIG=configs/chain_100m.yaml RECIPES=bf16 LRS=${LRS:-2e-6,1e-5,2e-5} SEEDS=0,1 EVAL_EVERY=${EVAL_EVERY:-25} \
  CONTINUE=${CONTINUE:-0} BUDGET_S=${BUDGET_S:-570} bash scripts/gpu_collapse.sh > $OUT/sweep.log 2>&1
tail -n 12 $OUT/sweep.log; ls -la $OUT; true
