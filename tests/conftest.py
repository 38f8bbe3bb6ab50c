"""Session-wide test set-up, the slow marker of subprocess-heavy modules, and the shared tiny models.

Without a GPU, Triton kernels run under Triton's CPU interpreter. Triton reads ``TRITON_INTERPRET``
when a kernel is decorated, so it must be set before any test module (or a module it imports) loads
``quads.kernels``: under pytest-xdist a worker may import the kernels from another test file first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # two shortcuts in the interpreter, the same bits (see the module)
    import triton_interpreter

    triton_interpreter.install()

# Under pytest-xdist every worker is one process per core: one torch thread each, so that two
# workers' OpenMP pools do not oversubscribe the cores (spin-waiting pools slow each other down
# by far more than the lost intra-op parallelism).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Test modules whose every test starts subprocesses (sandboxed programs, vLLM engines): marked slow as a
# whole, so ``pytest -m "not slow"`` is the quick loop. Single slow tests elsewhere carry
# ``@pytest.mark.slow`` themselves (the torchrun runs of test_distributed, the training runs of test_compare).
SLOW_MODULES = ("test_sandbox.py", "test_sandbox_escape.py", "test_vllm.py", "test_vllm_diagnose.py",
                "test_vllm_replay.py", "test_vllm_train.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


# Under CI (CI=true) property tests draw the same examples on every run, so a red CI always names a
# reproducible input and never comes from a new random draw; a local run keeps exploring new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# ---------------------------------------------------------------------- shared tiny models
# One tiny MoE (2 heads, 4 experts top-2, character vocabulary) for every test that needs "a model" or
# "a checkpoint" and not a particular architecture. Plain functions, so module-level helpers and
# subprocess set-ups can call them too (``from conftest import save_tiny_checkpoint``); a fixture below.

TINY_MODEL = dict(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=4, top_k=2,
                  moe_intermediate_size=32, max_seq_len=64)
# a little larger (2 layers, 64 wide): enough depth for per-layer errors and routing differences
SMALL_MODEL = dict(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4, top_k=2,
                   moe_intermediate_size=32, max_seq_len=128)


def tiny_model(seed: int = 0, **fields):
    """A seeded ``MoEForCausalLM`` with ``TINY_MODEL`` (``fields`` override it) and the char vocabulary."""
    from quads.model import ModelConfig, MoEForCausalLM
    from quads.model.tokenizer import CharTokenizer

    torch.manual_seed(seed)
    return MoEForCausalLM(ModelConfig(vocab_size=CharTokenizer().vocab_size, **{**TINY_MODEL, **fields}))


def save_tiny_checkpoint(path, extra: dict | None = None, seed: int = 0, **fields):
    """``tiny_model(seed, **fields)`` saved with its tokenizer (and ``extra``) at ``path``; the folder."""
    from quads.model.checkpoint import save_checkpoint
    from quads.model.tokenizer import CharTokenizer

    return save_checkpoint(tiny_model(seed, **fields), path, extra, tokenizer=CharTokenizer())


def save_vllm_policy(folder, n_layers: int = 2):
    """The vLLM tests' policy: the ``tiny`` preset with ``n_layers`` layers, vocabulary 128, fp32 and weights
    large enough (init std 0.08) that quantization visibly moves the log-probs, seeded, saved as a Hugging
    Face folder at ``folder``; returns ``(folder, tokenizer)``."""
    from quads.model.config import ModelConfig
    from quads.model.hf import save_hf_model
    from quads.model.tokenizer import CharTokenizer
    from quads.model.transformer import MoEForCausalLM

    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig.preset("tiny", n_layers=n_layers, dtype="float32", vocab_size=128,
                                              init_std=0.08))
    tok = CharTokenizer()
    save_hf_model(model, tok, folder)
    return folder, tok


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A ``SMALL_MODEL`` checkpoint shared by a test module (read only)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("small-ckpt") / "policy", **SMALL_MODEL)


class EchoTask:
    """A task whose right answer is always "1": a policy learns it in a few steps, so CLI and trainer
    tests see rewards move without a real task's cost."""

    name = "echo"

    def __init__(self, seed=0, **_):
        self.seed = seed

    def examples(self, split, n=None):
        import random

        from quads.tasks.base import Example

        rng = random.Random(f"{self.seed}:{split}")
        return [Example(f"Q{rng.randint(0, 999)}:", "1", "echo") for _ in range(n or 32)]

    def score(self, example, response):
        from quads.tasks.base import Score

        ok = response.startswith("1")
        return Score(float(ok), ok, "first char")

    def demonstration(self, example):
        return "1"


@pytest.fixture
def reference_quantizer(monkeypatch):
    """Without a GPU: ``quads.quant.ops.nvfp4_quantize`` (a layer's weight and activation quantizer) on the
    reference backend even inside ``dispatch.kernels("triton")``. Its Triton twin gives the same bits
    (tests/test_kernels.py checks them), so a test of something else on the Triton backend (the GEMM
    kernels, the stores a layer keeps) skips the interpreter's slow run of the quantizer. On CUDA, unchanged."""
    if torch.cuda.is_available():
        return
    from quads.kernels import dispatch
    from quads.quant import ops

    quantize = ops.nvfp4_quantize

    def reference_quantize(x, **opts):
        with dispatch.kernels("reference"):
            return quantize(x, **opts)

    monkeypatch.setattr(ops, "nvfp4_quantize", reference_quantize)


@pytest.fixture
def echo_task(monkeypatch):
    """Registers ``EchoTask`` as task ``echo`` for one test."""
    from quads import tasks

    monkeypatch.setitem(tasks.TASKS, "echo", EchoTask)


@pytest.fixture(scope="session")
def host_rac_kernels(tmp_path_factory):
    """RAC's CUDA kernels (``rac_operand.cuh``, ``rac_select.cuh``) built for the host once per session
    (``tests/host_kernels.py``; skips without g++)."""
    import host_kernels

    return host_kernels.build("rac_kernels_host.cpp", tmp_path_factory.mktemp("rac_kernels"))
