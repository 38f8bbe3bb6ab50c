"""The rollout seam in the import graph: the trainer (``quads.rl``) reaches rollout backends only through
``quads.rollout`` / ``quads.rollout.backend`` (the protocol, the factory, the batch types), and no rollout
module imports the trainer; only ``quads.rollout.vllm`` imports vLLM. Every import statement counts,
function-level ones included (a lazy import is still a dependency)."""

import ast
from pathlib import Path

QUADS = Path(__file__).resolve().parent.parent / "quads"
RL_MAY_IMPORT = ("quads.rollout", "quads.rollout.backend")  # the seam; its submodules are backends


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (``from a import b`` gives ``a`` and ``a.b``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        me = ".".join(rel.parts).removesuffix(".__init__")
        for line, mod in imports(path):
            where = f"{path.relative_to(root.parent)}:{line} imports {mod}"
            if under(me, "quads.rl") and under(mod, "quads.rollout") and mod not in RL_MAY_IMPORT:
                parent, _, name = mod.rpartition(".")
                sub = root.joinpath(*parent.split(".")[1:], name)
                names_a_type = parent in RL_MAY_IMPORT and not (sub.is_dir() or sub.with_suffix(".py").is_file())
                if not names_a_type:  # ``from quads.rollout import RolloutBatch`` names a type, not a module
                    bad.append(f"{where} (the trainer reaches backends only through quads.rollout)")
            if under(me, "quads.rl") and under(mod, "vllm"):
                bad.append(f"{where} (the trainer imports no backend)")
            if under(me, "quads.rollout") and (under(mod, "quads.rl") or under(mod, "quads.experiments")):
                bad.append(f"{where} (rollout backends do not import the trainer or the experiments)")
            if under(mod, "vllm") and not under(me, "quads.rollout.vllm"):
                bad.append(f"{where} (only quads.rollout.vllm imports vLLM)")
            if under(mod, "verl") and not under(me, "quads.integrations.verl"):
                bad.append(f"{where} (only quads.integrations.verl imports verl)")
    return bad


def test_rollout_seam_import_graph():
    assert violations(QUADS) == []


def test_the_check_sees_a_violation(tmp_path):
    pkg = tmp_path / "quads"
    for sub, text in {"rl/trainer.py": "def f():\n    from quads.rollout.vllm.engine import make_rollout_engine\n",
                      "rollout/vllm/compare.py": "from quads.rl.logprobs import forward_logprobs\n",
                      "rollout/engine.py": "from quads.rollout.decode import StaticDecoder\n",
                      "rl/logprobs.py": "from quads.rollout import RolloutBatch\n",
                      "rl/grpo.py": "from quads.rollout import engine\n"}.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    found = violations(pkg)
    assert sorted({f.split(" imports ")[0] for f in found}) == [
        "quads/rl/grpo.py:1", "quads/rl/trainer.py:2", "quads/rollout/vllm/compare.py:1"], found


def test_importing_the_trainer_loads_no_backend():
    """At run time too: importing ``quads.rl`` (whose modules import the ``quads.rollout`` package) loads
    no backend module; ``make_backend`` loads the one the config names."""
    import subprocess
    import sys

    code = ("import sys, quads.rl.trainer, quads.rl.distributed, quads.rl.build, quads.rl.logprobs; "
            "print(sorted(m for m in sys.modules if m.startswith(('quads.rollout.', 'quads.experiments', 'vllm')))); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[-3] == "['quads.rollout.backend', 'quads.rollout.types']", out
    # nor torch.compile's machinery (~3 s of CPU per process): quads loads it where it compiles
    assert out[-2] == "False", out
