#!/usr/bin/env bash
# Issue 17: where RAC's CUDA selection (quads.kernels.rac_select_cuda) spends its ~10.6 us a call at K = 1,024 (runs
# 79-80: flat over 8-32 warps; 16 rows' loads in flight instead of 2 took only 0.7 us off): Nsight Compute's raw
# warp-state (stall reasons), scheduler, occupancy, launch and source sections for one call at the 1b decode shape
# (1,024 sorted rows over 64 experts), K = 1,024 with 16 warps and K = 256 with 8 (tuning.json's). One GPU, ~1-2
# minutes. OUT=$OUT bash scripts/device_calls/2027-01-10_ncu_rac_select.sh
export PYTHONPATH=.; mkdir -p $OUT; git log --oneline -1 > $OUT/tree.txt 2>&1
cat > $OUT/drive.py <<'PY'
import sys

import torch

from quads.kernels import rac_select_cuda
from quads.model.moe import static_routes

k, warps = int(sys.argv[1]), int(sys.argv[2])
e, tokens, topk, n = 64, 128, 8, k // 2
g = torch.Generator().manual_seed(0)
idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).cuda()
group = static_routes(idx, e).expert.contiguous()
r = torch.randn(tokens * topk, k, generator=g).mul(torch.logspace(-3, 1, k)).cuda()
s = torch.empty(e, n, dtype=torch.long, device="cuda")
rank = torch.empty(e, k, dtype=torch.int32, device="cuda")
gmax = torch.empty(e + 1, dtype=torch.float32, device="cuda")
for _ in range(3):
    rac_select_cuda.select(r, group, s, rank, gmax, n=n, groups=e, per_token=False, warps=warps)
torch.cuda.synchronize()
PY
python3 -c "from quads.kernels import rac_select_cuda; import torch; torch.zeros(1).cuda(); rac_select_cuda.build()" \
  > $OUT/build.log 2>&1  # the build outside the profiled process
for kw in "1024 16" "256 8"; do
  echo "== K warps $kw" >> $OUT/ncu.txt
  timeout 150 ncu --clock-control none --kernel-name regex:select_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section SourceCounters --page raw python3 $OUT/drive.py $kw >> $OUT/ncu.txt 2>&1
  echo "rc=$?" >> $OUT/ncu.txt
done
grep -h "== \|stalled.*ratio\|launch__registers_per_thread \|gpu__time_duration.sum\|rc=" $OUT/ncu.txt | head -80; true
