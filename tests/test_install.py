"""`pip install .` (not editable) into a fresh venv, then `pdflow plan` from elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tracked_copy(dest: Path) -> Path:
    """Copy what a clean checkout holds (git's tracked files, plus untracked ones not ignored)."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in listing:
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def dependency_dirs() -> list[str]:
    """This interpreter's package folders (venv and, when visible, system ones), never
    the checkout itself. A venv inside the checkout (``.venv/``, as the README makes) is
    kept: its site-packages holds the dependencies. The .pth lists plain folders, so no
    editable-install hook of pdflow inside them runs."""
    return [
        p for p in sys.path
        if p and Path(p).name in ("site-packages", "dist-packages")
        and Path(p).resolve() != REPO
    ]


@pytest.mark.slow
def test_non_editable_install_runs_plan_from_another_directory(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to know which files are tracked")
    src = tracked_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    # An isolated venv that sees this environment's dependencies through a .pth file (no
    # network needed). --system-site-packages would not do: run from a venv, it shows the
    # base interpreter's packages, not the venv's. pdflow itself comes only from the
    # copied tree, installed from a wheel, not editable.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    inner_site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    (Path(inner_site) / "outer_env.pth").write_text("\n".join(dependency_dirs()) + "\n")
    # Build the wheel with this interpreter's setuptools (the test extra's; a fresh venv's
    # bundled one may predate bdist_wheel), then install only that wheel into the venv.
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(dist.glob("pdflow-*.whl"))
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [
            py,
            "-c",
            "import pdflow, pdflow.kernels, pdflow.conf; print(pdflow.__file__, pdflow.kernels.__file__)",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(venv) in where and str(REPO) not in where
    exe = venv / "bin" / "pdflow"
    for args, ok in [
        ((), True),
        (("+experiment=ref_pp4_tp4_dspark",), True),
        (("prefill=pp4", "decode=tp4", "drafter=eagle3"), False),
    ]:
        out = subprocess.run([exe, "plan", *args], cwd=elsewhere, capture_output=True, text=True, timeout=120)
        assert (out.returncode == 0) is ok, out.stdout + out.stderr
        if not ok:
            assert "EAGLE3_UNDER_PP" in out.stdout + out.stderr


def test_every_subpackage_is_packaged():
    """pyproject lists packages by name (kernels/ and conf/ install under pdflow.*), so a new
    subpackage missing from the list installs editable but is absent from a wheel."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {name: REPO / path for name, path in tool["package-dir"].items()}
    found = set()
    for name, root in dirs.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            if "__pycache__" not in rel:
                found.add(".".join((name, *rel)))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
