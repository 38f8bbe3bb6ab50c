#!/usr/bin/env bash
# Issue 17, after 2026-12-23_shared_prefill.sh and 2026-12-24_decode_tune_1b.sh on the same warm machine (the caches
# under cache/): the rest of the GPU contracts on the shared-prefill default (weight sync reaching the captured graphs,
# graph = no graph for the compiled w4a16 and w4a4+rac50 paths, no host sync in a step), then the three 1b rows in one
# process with the committed tuning table (reps 3). Run 62 ran this command inline.
# OUT=$OUT bash scripts/device_calls/2026-12-25_contracts_repeat.sh
export PYTHONPATH=. TORCHINDUCTOR_CACHE_DIR=$PWD/cache/inductor TRITON_CACHE_DIR=$PWD/cache/triton; G=tests/test_engine_gpu.py
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
timeout 200 python3 -m pytest -q "$G::test_weight_sync_reaches_captured_graph" "$G::test_graph_matches_no_graph[w4a16-1.0-True]" \
  "$G::test_graph_matches_no_graph[w4a4+rac50-1.0-True]" "$G::test_decode_step_has_no_host_sync" > $OUT/gpu_tests2.txt 2>&1
echo "rc=$?" >> $OUT/gpu_tests2.txt; tail -3 $OUT/gpu_tests2.txt
timeout 190 python3 -u benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 3 --new-tokens 64 --long-tokens 0 \
  --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e_repeat.json > $OUT/e2e_repeat.log 2>&1
echo "rc=$?" >> $OUT/e2e_repeat.log; grep "x bf16\|rc=" $OUT/e2e_repeat.log
