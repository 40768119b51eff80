"""The manual cannot rot: docs/ builds with `mkdocs build --strict` (every page in the
navigation, every link and anchor found), its generated pages match the code, and the README
stays a short door into it that names every package of jobs/. Needs nothing but the files
(unit tier)."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_the_manual_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = _run(str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "glossary" / "index.html").exists()


def test_the_generated_pages_match_the_code():
    for script in ("docs/gen_packages.py", "docs/gen_settings.py"):
        done = _run(sys.executable, script, "--check")
        assert done.returncode == 0, done.stdout + done.stderr


def _jobs_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c.get("containers") == ["jobs"]]
    return [part.strip() for layer in contract["layers"] for part in layer.split("|")]


def test_the_readme_is_a_short_door_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in ("make run", "make test", "make test-fast", "make docs"):
        assert command in readme
    # Every link stays inside the repository (the docs, or a file that exists).
    for target in re.findall(r"\]\(([^)#]+)", readme):
        assert not target.startswith(("http:", "https:", "../")), target
        assert (ROOT / target).exists(), target
    # The who-owns-what table and the architecture name every package of jobs/.
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    packages = [p for p in _jobs_packages() if p not in ("apps", "migrations")]
    for package in packages:
        assert re.search(rf"`(jobs/)?{package}(/|\.py)`", readme), package
        assert f"`{package}`" in architecture, package


def _pages() -> list[Path]:
    return sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md"]


def test_every_file_the_docs_name_exists():
    """A path such as `jobs/files/storage.py` or `tests/test_gateway.py` in the README or the
    manual is a file or folder of the repository (moving one means updating the docs)."""
    path = re.compile(
        r"(?<![\w/.-])((?:console|jobs|billing|monitoring|tests|bench|cli|docs|\.ci)/[\w./-]*\w)"
    )
    missing = [
        f"{page.relative_to(ROOT)}: {found}"
        for page in _pages()
        for found in sorted(set(path.findall(page.read_text())))
        if not (ROOT / found).exists()
    ]
    assert not missing, "\n".join(missing)


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    if dotted.startswith("suanli_cli"):
        base = ROOT / "cli" / base.relative_to(ROOT)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def test_every_module_and_name_the_docs_name_exists():
    """A dotted name such as `jobs.placement.fleet.job_for_user` names a module that exists
    and, after it, something that module defines or imports. `jobs.view_job_logs` (a
    permission: no module after the app) is not a module path and is left alone."""
    dotted = re.compile(
        r"(?<![\w./-])((?:jobs|console|billing|monitoring|suanli_cli)(?:\.[A-Za-z_]\w*)+)"
    )
    wrong = []
    for page in _pages():
        for ref in sorted(set(dotted.findall(page.read_text()))):
            parts = ref.split(".")
            known = len(parts)
            while known > 1 and _module_file(".".join(parts[:known])) is None:
                known -= 1
            if known == 1 or known == len(parts):
                continue
            name = parts[known]
            source = _module_file(".".join(parts[:known])).read_text()
            defined = rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^(?:from|import)\s.*\b{name}\b"
            if not re.search(defined, source, re.M):
                wrong.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not wrong, "\n".join(wrong)


def test_a_name_after_a_file_is_defined_in_it():
    """`jobs/hosts/services.py` `host_check`: the function (or class, or setting) named right
    after a file is defined in that file."""
    named = re.compile(r"`((?:console|jobs|billing|monitoring|cli|bench)/[\w/]+\.py)`\s*\(?`(\w+)")
    wrong = []
    for page in _pages():
        for path, name in sorted(set(named.findall(page.read_text()))):
            source = (ROOT / path).read_text() if (ROOT / path).exists() else ""
            defined = rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]"
            if not re.search(defined, source, re.M):
                wrong.append(f"{page.relative_to(ROOT)}: {path} {name}")
    assert not wrong, "\n".join(wrong)


def test_the_code_cites_only_documents_inside_the_repository():
    """Comments and docstrings point at the docs/ pages, never at a design document outside
    the repository or at a README section (the manual left the README)."""

    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh", "*.html", "*.toml", "Procfile", "Makefile"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    stale = re.compile(r"DESIGN\.md|README[ ,]+\"")
    here = Path(__file__).name
    found = [
        f"{name}:{n}"
        for name in tracked
        if Path(name).name != here
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if stale.search(line)
    ]
    assert not found, found
