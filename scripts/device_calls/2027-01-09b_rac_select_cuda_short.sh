#!/usr/bin/env bash
# Run 79's follow-up, for a short budget: RAC's CUDA selection with its rows' loads 16 in flight (run 79 had 2, a
# latency chain over the expert's rows), the probe first (the operand alone in a CUDA graph, both backends, each warp
# count, the same bits checked at the 1b decode shapes), then the GPU tests that run 79's 170 s did not reach (K = 256
# first: NaN, inf, ties, masked rows, per token, every warp count). One GPU, <= TOTAL s. OUT=$OUT TOTAL=330 bash scripts/device_calls/2027-01-09b_rac_select_cuda_short.sh
. scripts/device_calls/lib.sh
git log --oneline -1 > $OUT/tree.txt 2>&1
timeout $(cap 110) python3 -u scripts/device_calls/rac_select_cuda_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/probe.err
T=tests/test_rac_select_cuda.py::test_cuda_selection_is_the_triton_selection_bit_for_bit
timeout $(cap 400) python3 -m pytest -q -p no:cacheprovider -rA "$T[group-256-128-bfloat16]" "$T[token-256-128-bfloat16]" \
  tests/test_rac_select_cuda.py::test_cuda_selection_rank_and_gmax_equal_the_triton_kernel \
  tests/test_rac_select_cuda.py::test_cuda_selection_replays_in_a_graph \
  tests/test_rac_select_cuda.py::test_cuda_backend_falls_back_to_triton_where_it_cannot_run \
  "$T[group-64-32-float32]" "$T[token-208-208-bfloat16]" "$T[group-1024-512-bfloat16]" "$T[token-1024-16-float32]" \
  "$T[group-16-16-bfloat16]" > $OUT/gpu_tests_rac_cuda.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests_rac_cuda.log
cat $OUT/gpu.txt; cat $OUT/probe.jsonl; tail -n 2 $OUT/probe.err; grep -E "PASSED|FAILED|ERROR|rc=|passed|failed" $OUT/gpu_tests_rac_cuda.log | tail -n 20
true
