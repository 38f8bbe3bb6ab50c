"""Per-layer activation absmax of a checkpoint's RMSNorm outputs: the outlier channels against the rest.

    python scripts/outlier_absmax.py CHECKPOINT [--channels 5,40,77] [--site mlp] [--device cpu]

Runs 8 training demonstrations of the checkpoint's task (``extra.task``) through the model and prints,
per layer, the max |activation| of the ``site`` norm's output (what the router and experts read) on each
given channel (default: the checkpoint's ``extra.outliers.channels``) and the median and max over the
other channels; one JSON line at the end. Shows whether a model carries outlier channels (injected,
grown from an outlier-gain init, or none).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from quads.model.checkpoint import load_model
    from quads.model.outliers import norm_output_absmax
    from quads.outliers_cli import probe_ids

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--channels", default="", help="comma-separated channels (default: the checkpoint's outliers)")
    ap.add_argument("--site", default="mlp", choices=["mlp", "attn"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model, tok, extra = load_model(args.checkpoint, device=args.device)
    channels = ([int(c) for c in args.channels.split(",") if c.strip()] if args.channels
                else list(extra.get("outliers", {}).get("channels", [])))
    with torch.no_grad():
        amax = norm_output_absmax(model.eval(), probe_ids(tok, extra, args.device), args.site)  # [L, H]
    others = [c for c in range(amax.shape[1]) if c not in channels]
    print(f"| layer | {' | '.join(f'ch {c}' for c in channels)} | others median | others max |\n"
          f"|---|{'---|' * len(channels)}---|---|")
    rows = []
    for i, a in enumerate(amax):
        rest = a[others]
        rows.append({"layer": i, "channels": {c: a[c].item() for c in channels},
                     "others_median": rest.median().item(), "others_max": rest.max().item()})
        print(f"| {i} | {' | '.join(f'{a[c].item():.3g}' for c in channels)} | {rest.median().item():.3g} | "
              f"{rest.max().item():.3g} |")
    print(json.dumps({"metric": "outlier_absmax", "checkpoint": args.checkpoint, "site": args.site,
                      "outliers": extra.get("outliers"), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
