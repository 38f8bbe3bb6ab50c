"""scripts/sass_w4a16.py's occupancy arithmetic against what Nsight Compute measured on an H200."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import sass_w4a16  # noqa: E402


def test_resident_blocks_match_nsight_compute_for_the_grouped_decode_kernel():
    # benchmarks/results/2026-12-03_h200_ncu_grouped_gate_up.txt: 225 registers, 128 threads, 41.98 KB of
    # dynamic shared memory -> "Block Limit Registers 2", 8 theoretical warps per SM
    r = sass_w4a16.resident(225, 4, 41984)
    assert r["blocks_by_registers"] == 2 and r["blocks_per_sm"] == 2 and r["warps_per_sm"] == 8
    assert r["blocks_by_shared"] == 5  # at the largest carveout (ncu's driver chose 132 KB: 3)
    # 128 registers is 4 warps per scheduler: 16 warps, 4 blocks of 4; 8 warps per block halves the blocks
    assert sass_w4a16.resident(128, 4, 14592)["warps_per_sm"] == 16
    assert sass_w4a16.resident(136, 8, 41984)["blocks_per_sm"] == 1
    assert sass_w4a16.resident(None, 4, 0) == {}
