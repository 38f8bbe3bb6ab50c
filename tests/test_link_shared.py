"""scripts/link_shared.py: the side venvs' set-up takes distributions of the main venv as hard links of the
files their RECORD lists inside site-packages, at the asked version only, never over one already there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("link_shared", ROOT / "scripts" / "link_shared.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return next((path / "lib").glob("python*/site-packages"))


def _dist(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
    rows = []
    for rel, text in files.items():
        if not rel.startswith("../"):
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
        rows.append(f"{rel},,")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_links_the_asked_versions_and_nothing_outside_site_packages(tmp_path, capsys):
    main_site, new_site = _venv(tmp_path / "main"), _venv(tmp_path / "new")
    _dist(main_site, "big_lib", "1.2.0+cpu", {"big_lib/__init__.py": "X = 1\n", "big_lib/sub/m.py": "",
                                              "../../../bin/big-cli": "#!/main/python\n"})
    _dist(main_site, "Other.Lib", "3.0", {"other_lib/__init__.py": ""})
    _dist(main_site, "pinned", "2.0", {"pinned.py": ""})
    _dist(new_site, "present", "1.0", {"present.py": "new"})
    _dist(main_site, "present", "9.0", {"present.py": "main"})
    rc = _module().main([str(tmp_path / "main"), str(tmp_path / "new"), "big-lib==1.2.0", "other_lib",
                         "pinned==2.1", "present", "absent"])
    assert rc == 0
    for rel in ("big_lib/__init__.py", "big_lib/sub/m.py", "big_lib-1.2.0+cpu.dist-info/RECORD", "other_lib/__init__.py"):
        assert (new_site / rel).stat().st_ino == (main_site / rel).stat().st_ino, rel  # a hard link, not a copy
    assert not (tmp_path / "new" / "bin" / "big-cli").exists()  # its first line names the main venv's python
    assert not (new_site / "pinned.py").exists()  # 2.0 installed, 2.1 asked
    assert (new_site / "present.py").read_text() == "new" and not (new_site / "present-9.0.dist-info").exists()
    assert "linked from" in capsys.readouterr().out


def test_another_python_or_a_missing_venv_links_nothing(tmp_path):
    new_site = _venv(tmp_path / "new")
    assert _module().main([str(tmp_path / "nowhere"), str(tmp_path / "new"), "anything"]) == 0
    assert [p.name for p in new_site.iterdir()] == []
