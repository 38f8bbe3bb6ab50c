"""Adopt the fastest fused-kernel prefill launch config per weight shape from a ``bench_kernels --only moe_prefill``
JSON: ``tuning.json`` ``w4a16_grouped_gemm.n{N}_k{K}_prefill`` for each shape where a config with the table
config's bits beats it by ``--min-gain`` (a device call's step before re-timing the rollout with it).

    python scripts/device_calls/adopt_prefill_configs.py moe_prefill.json [--min-gain 1.03] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from quads.kernels import tuning  # noqa: E402


def _dumps(table: dict) -> str:
    """``tuning.json``'s layout: a kernel per block, a case per line."""
    kernels = []
    for kernel, cases in table.items():
        body = ",\n".join(f"    {json.dumps(c)}: {json.dumps(v)}" for c, v in cases.items())
        kernels.append(f"  {json.dumps(kernel)}: {{\n{body}\n  }}")
    return "{\n" + ",\n".join(kernels) + "\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--min-gain", type=float, default=1.03, help="x_vs_table a config needs to be adopted")
    ap.add_argument("--dry-run", action="store_true", help="print the choice, leave tuning.json as it is")
    args = ap.parse_args()
    rows = [r for r in json.load(open(args.bench_json))["rows"] if r.get("bench") == "grouped MoE W4A16 prefill config"]
    best: dict[str, dict] = {}
    for r in rows:
        if "us" not in r or not r.get("same_bits") or r["x_vs_table"] < args.min_gain:
            continue
        n, k = re.search(r"N=(\d+) K=(\d+)", r["shape"]).groups()
        key = f"n{n}_k{k}_prefill"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    table = json.loads(Path(tuning.PATH).read_text())
    base = table["w4a16_grouped_gemm"]["prefill"]
    for key, r in best.items():
        bm, bn, bk, warps, stages = r["cfg"]
        table["w4a16_grouped_gemm"][key] = {**base, "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                                            "num_stages": stages, "split_k": 1}  # fmt: skip
        print(f"{key}: {r['cfg']} {r['us']:.1f} us vs table {r['table_fused_us']:.1f} ({r['x_vs_table']:.2f}x)")
    if not best:
        print("no config beats the table's by", args.min_gain)
    if best and not args.dry_run:
        tmp = Path(str(tuning.PATH) + ".tmp")
        tmp.write_text(_dumps(table))
        tmp.replace(tuning.PATH)


if __name__ == "__main__":
    main()
