"""kernels/ (installed as pdflow.kernels) holds kernels, launchers and torch references;
the benchmark harness lives in scripts/kernel_bench/ and nothing installed imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "scripts" / "kernel_bench"
HARNESS_NAMES = {"benchmarks", "sweep", "aot_check", "testing", "prefill_variants", "rotated",
                 "paged_inputs", "shapes"}


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative ones resolved inside its package)."""
    pkg = path.parent.name
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"{pkg}.{base}" if base else pkg
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def test_kernels_package_holds_no_harness():
    stray = {p.stem for p in (REPO / "kernels").glob("*.py")} & HARNESS_NAMES
    assert not stray, f"benchmark harness in the installed kernels/: {sorted(stray)}"


def _is_harness(name: str) -> bool:
    parts = name.split(".")
    if parts[0] == "kernel_bench":
        return True
    kernels = parts[2:3] if parts[:2] == ["pdflow", "kernels"] else \
        parts[1:2] if parts[0] == "kernels" else []
    return bool(set(kernels) & HARNESS_NAMES)


def test_installed_code_never_imports_the_harness():
    assert _is_harness("pdflow.kernels.testing") and _is_harness("kernels.sweep")
    for path in [*(REPO / "pdflow").rglob("*.py"), *(REPO / "kernels").glob("*.py")]:
        bad = sorted(n for n in _imports(path) if _is_harness(n))
        assert not bad, f"{path.relative_to(REPO)} imports harness code: {bad}"


def test_harness_imports_run_one_way():
    """No two harness modules import each other (benchmarks and sweep used to)."""
    local = {p.stem: {n.split(".")[1] for n in _imports(p)
                      if n.startswith("kernel_bench.") and n.count(".") >= 1}
             for p in HARNESS.glob("*.py")}
    for mod, deps in local.items():
        for dep in deps:
            assert mod not in local.get(dep, set()), f"kernel_bench.{mod} <-> {dep}"


# Lab-notebook markers: which sweep round or issue found something belongs in
# bench/KERNEL_NOTES.md and git, not beside the code.
NOTEBOOK = re.compile(r"\bround \d|\bround-\d|\bissue \d|\b(first|second|third) (H200|GPU) run|"
                      r"\br\d best\b", re.IGNORECASE)


def test_kernel_comments_carry_no_history():
    files = [*(REPO / "kernels").glob("*.py"), *(REPO / "pdflow" / "attention").glob("*.py")]
    assert NOTEBOOK.search("the first H200 run, round 4 (issue 6)")
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if NOTEBOOK.search(line)]
    assert not hits, "\n".join(hits)
