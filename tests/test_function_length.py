"""No function over 80 lines without a reason: a long one is cut into named steps, or its
docstring says why it is one piece, in a sentence starting "Long because" (issue 39).
Reads the source with `ast`; needs no database."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("console", "jobs", "billing", "monitoring")
MOST_LINES = 80
REASON = "Long because"


def long_functions(root: Path = ROOT) -> list[str]:
    """'path:line name (N lines)' of each function over MOST_LINES lines (its decorators
    left out) whose docstring gives no reason; migrations are generated, so not read."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.relative_to(root).parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > MOST_LINES and REASON not in (ast.get_docstring(node) or ""):
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines_without_a_reason():
    found = long_functions()
    assert not found, (
        f"Over {MOST_LINES} lines: cut into named steps, or say why in the docstring with a "
        f'sentence starting "{REASON}":\n' + "\n".join(found)
    )


def test_the_walk_sees_a_long_function_and_its_reason(tmp_path):
    """The check itself: a long function is found, and a reason in its docstring (not a
    comment) lets it be."""
    body = "\n".join(f"    x{n} = {n}" for n in range(MOST_LINES))
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "long.py").write_text(
        f"def bare():\n{body}\n\n\n"
        f"def commented():\n    # {REASON} it is.\n{body}\n\n\n"
        f'def reasoned():\n    """{REASON} it is one table."""\n{body}\n'
    )
    (tmp_path / "jobs" / "migrations").mkdir()
    (tmp_path / "jobs" / "migrations" / "0001.py").write_text(f"def generated():\n{body}\n")
    found = long_functions(tmp_path)
    assert [entry.split()[1] for entry in found] == ["bare", "commented"], found
