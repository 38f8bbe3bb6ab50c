#!/usr/bin/env bash
# Issue 17: the 1b step is ~650-850 kernels in one CUDA graph (runs 20-41's profiles), so launch gaps between
# dependent kernels are a large share of a ~3 ms step. A/B on one machine: Inductor's Programmatic Dependent
# Launch (torch._inductor.config.triton.enable_pdl, env TORCHINDUCTOR_ENABLE_PDL) off then on, the 1b e2e rows
# for bf16, w4a16, w4a4+rac50; the first run's Inductor cache keeps the source of the attention-side fused kernels
# (18 us a layer in runs 20 and 41, 3 us in run 31) for reading here. First: what one kernel boundary costs in a graph
# (benchmarks/bench_graph_launch.py: chains of tiny dependent kernels, plain, with PDL, ATen). One H200, <= 470 s.
# OUT=$OUT bash scripts/device_calls/2026-12-13_pdl.sh
export PYTHONPATH=.; mkdir -p $OUT; git rev-parse HEAD > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt
T0=$(date +%s); left() { echo $(( 470 - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ $l -lt $1 ] && echo $l || echo $1; }
python3 -c "import torch, triton, torch._inductor.config as c; print(torch.__version__, triton.__version__,
'enable_pdl' in dir(c.triton))" > $OUT/versions.txt 2>&1
timeout $(cap 60) python3 benchmarks/bench_graph_launch.py --n 256 --json $OUT/graph_launch.json > $OUT/graph_launch.log 2>&1
echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/graph_launch.log
for PDL in 0 1; do
  IC=$(mktemp -d); export TORCHINDUCTOR_CACHE_DIR=$IC TORCHINDUCTOR_ENABLE_PDL=$PDL
  timeout $(cap 200) python3 benchmarks/bench_e2e.py --suites rollout --preset 1b --reps 2 --new-tokens 64 \
    --long-tokens 0 --graphs on --compile on --recipes bf16,w4a16,w4a4+rac50 --json $OUT/e2e_pdl$PDL.json \
    > $OUT/e2e_pdl$PDL.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/e2e_pdl$PDL.log
  [ $PDL = 0 ] && python3 scripts/device_calls/pick_inductor_kernels.py $IC $OUT/inductor \
    triton_per_fused__to_copy__unsafe_view_add_arange_cat_cos triton_poi_fused__to_copy_div_index_index_copy \
    > $OUT/inductor_pick.txt 2>&1 && (cd $OUT && tar czf inductor.tgz inductor && rm -rf inductor)
  grep -c "launch_pdl.*True\|gdc_wait" -r $IC 2>/dev/null | awk -F: '{s+=$2} END {print "pdl mentions", s}' >> $OUT/e2e_pdl$PDL.log
done
cat $OUT/versions.txt $OUT/inductor_pick.txt; grep -o '"kind.*us_per_kernel[^,]*\|"kind.*error.\{0,80\}' $OUT/graph_launch.log; for PDL in 0 1; do grep "^rollout" $OUT/e2e_pdl$PDL.log; tail -n 2 $OUT/e2e_pdl$PDL.log; done; true
