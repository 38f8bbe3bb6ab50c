"""The cost of a training checkpoint of the default ``quads train`` model (what ``log.save_every`` pays).

    python benchmarks/bench_checkpoint.py [--preset tiny] [--reps 10] [--threads 1] [--json F]

Builds the trainer of the default ``TrainConfig`` (recipe ``quads``) on a randomly initialised
``--preset`` model (the warm start has the same tensors), gives AdamW its state with one optimizer step
on zero gradients, then times ``GRPOTrainer.save`` ``--reps`` times into a temp run folder: the whole
atomic write (master weights, AdamW moments, RNG and sampler state, static-RAC buffers, ``torch.save`` into
a temp folder, rename, ``latest`` pointer, pruning to the two newest). Prints the median and max seconds,
the size of ``state.pt``, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quads.model import ModelConfig, MoEForCausalLM  # noqa: E402
from quads.model.checkpoint import save_checkpoint  # noqa: E402
from quads.model.tokenizer import CharTokenizer  # noqa: E402
from quads.rl.checkpoint import STATE_FILE  # noqa: E402
from quads.rl.config import LogSection, ModelSection, TrainConfig  # noqa: E402
from quads.rl.trainer import GRPOTrainer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--json", default=None, help="also write the JSON line to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok = CharTokenizer()
        model = MoEForCausalLM(ModelConfig.preset(args.preset, vocab_size=tok.vocab_size))
        ckpt = save_checkpoint(model, Path(tmp) / "ckpt", tokenizer=tok)
        cfg = TrainConfig(model=ModelSection(checkpoint=str(ckpt)), out_dir=str(Path(tmp) / "run"),
                          log=LogSection(tensorboard=False, progress=False), threads=args.threads)
        trainer = GRPOTrainer(cfg, quiet=True)
        trainer.eval_history = []
        trainer.setup()
        for p in trainer.params:
            p.grad = torch.zeros_like(p)
        trainer.opt.step()  # AdamW moments exist, as after any step
        times = []
        for step in range(1, args.reps + 1):
            t0 = time.perf_counter()
            path = trainer.save(step)
            times.append(time.perf_counter() - t0)
        size_mb = (path / STATE_FILE).stat().st_size / 2**20
    n_params = sum(p.numel() for p in trainer.params)
    med = statistics.median(times)
    print(f"checkpoint of the default trainer, preset {args.preset} ({n_params / 1e6:.2f}M parameters, "
          f"{size_mb:.1f} MiB state.pt): median {med * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms over {args.reps}; "
          f"at log.save_every={LogSection().save_every}: {med / LogSection().save_every * 1e3:.0f} ms per step")
    line = {"metric": "checkpoint_save", "preset": args.preset, "params": n_params, "state_mib": round(size_mb, 2),
            "median_s": round(med, 4), "max_s": round(max(times), 4), "reps": args.reps,
            "save_every": LogSection().save_every, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine()}
    print(json.dumps(line))
    if args.json:
        Path(args.json).write_text(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
