"""Atomic writes (``quads.io``): outputs get the mode the umask allows, like a plain open / mkdir."""

import os
import stat

import pytest
import torch

from quads.io import atomic_dir, atomic_write_json, atomic_write_text


@pytest.fixture(params=[0o022, 0o002, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_files_and_folders_respect_the_umask(tmp_path, umask):
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "b.json", {"x": 1})
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "f").write_text("y")
    assert mode(tmp_path / "a.txt") == mode(tmp_path / "b.json") == 0o666 & ~umask
    assert mode(tmp_path / "d") == 0o777 & ~umask
    assert mode(tmp_path / "d" / "f") == 0o666 & ~umask
    assert os.umask(umask) == umask  # the umask itself is left as it was


def test_checkpoint_and_export_are_readable_by_others_under_umask_022(tmp_path):
    from quads.cli import main
    from quads.model.checkpoint import save_checkpoint
    from quads.model.config import ModelConfig
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    old = os.umask(0o022)
    cfg = ModelConfig(vocab_size=100, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                      n_experts=2, top_k=1, moe_intermediate_size=32, max_seq_len=32)
    torch.manual_seed(0)
    ckpt = save_checkpoint(MoEForCausalLM(cfg), tmp_path / "ckpt", tokenizer=CharTokenizer())
    assert main(["export", "--checkpoint", str(ckpt), "--format", "bf16", "--out", str(tmp_path / "e")]) == 0
    os.umask(old)
    for folder in (ckpt, tmp_path / "e"):
        assert mode(folder) == 0o755
        assert {mode(p) for p in folder.iterdir()} == {0o644}
