"""Writes docs/packages.md: a Mermaid diagram of the apps and of jobs/' packages, drawn from
the import-linter layers in pyproject.toml and the imports the code really makes (grimp,
the graph import-linter itself builds).

Run by `make docs`; tests/test_docs.py fails when the committed page differs from what this
writes, so a new package or a new dependency between packages reaches the docs. `--check`
prints what differs and exits 1 instead of writing.
"""

from __future__ import annotations

import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "packages.md"


def _contracts() -> tuple[list[str], list[str], list[list[str]]]:
    """(root packages, the apps' layers top to bottom, jobs' layers top to bottom: each a
    list of package names)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    apps: list[str] = []
    jobs: list[list[str]] = []
    for contract in config["contracts"]:
        if contract["type"] != "layers":
            continue
        layers = [[part.strip() for part in layer.split("|")] for layer in contract["layers"]]
        if contract.get("containers") == ["jobs"]:
            jobs = layers
        elif not contract.get("containers"):
            apps = [" | ".join(layer) for layer in layers]
    return config["root_packages"], apps, jobs


def _node(module: str, roots: list[str]) -> str:
    """The box a module belongs to: `jobs.<package>` inside jobs/, else its app."""
    parts = module.split(".")
    if parts[0] == "jobs" and len(parts) > 1:
        return "jobs." + parts[1]
    return parts[0]


def _edges(roots: list[str]) -> dict[str, set[str]]:
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*roots)
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        source = _node(module, roots)
        for imported in graph.find_modules_directly_imported_by(module):
            target = _node(imported, roots)
            if target != source and target.split(".")[0] in roots:
                edges[source].add(target)
    return edges


def _reduced(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows no longer path already implies (transitive reduction; the layers make the
    graph acyclic), so the drawing stays readable. The tables list every direct import."""

    def reach(start: str, skip: str) -> set[str]:
        seen: set[str] = set()
        todo = [t for t in edges.get(start, ()) if t != skip]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, ()))
        return seen

    return {s: {t for t in ts if t not in reach(s, t)} for s, ts in edges.items()}


def _id(name: str) -> str:
    return name.replace(".", "_")


def render() -> str:
    roots, apps, jobs_layers = _contracts()
    edges = _edges(roots)
    layer_of = {f"jobs.{pkg}": i + 1 for i, layer in enumerate(jobs_layers) for pkg in layer}

    lines = ["```mermaid", "flowchart TB"]
    for app in roots:
        if app != "jobs":
            lines.append(f"    {_id(app)}[{app}/]")
    lines.append('    subgraph jobs["jobs/ (one Django app)"]')
    lines.append("        direction TB")
    for i, layer in enumerate(jobs_layers, 1):
        lines.append(f'        subgraph L{i}["layer {i}"]')
        lines.append("            direction LR")
        for pkg in layer:
            lines.append(f"            {_id('jobs.' + pkg)}[{pkg}]")
        lines.append("        end")
    lines.append("    end")
    # Apps: one arrow to jobs/ as a whole; inside jobs/: package to package.
    inside = {
        s: {t for t in ts if t.startswith("jobs.")}
        for s, ts in edges.items()
        if s.startswith("jobs.")
    }
    drawn = {**edges, **_reduced(inside)}
    for source in sorted(drawn):
        targets = sorted(drawn[source])
        if source.startswith("jobs."):
            for target in targets:
                if target.startswith("jobs."):
                    lines.append(f"    {_id(source)} --> {_id(target)}")
        else:
            apps_hit = sorted({t.split(".")[0] for t in targets})
            for target in apps_hit:
                lines.append(f"    {_id(source)} --> {_id(target)}")
    lines.append("```")

    table = ["| package | layer | imports from |", "|---|---|---|"]
    for name in sorted(layer_of, key=lambda n: (layer_of[n], n)):
        uses = ", ".join(f"`{t.split('.', 1)[1]}`" for t in sorted(edges.get(name, ())))
        table.append(f"| `{name}` | {layer_of[name]} | {uses} |")
    apps_table = ["| app | imports from |", "|---|---|"]
    for app in roots:
        if app == "jobs":
            continue
        uses = sorted({t.split(".")[0] for t in edges.get(app, ())})
        apps_table.append(f"| `{app}` | {', '.join(f'`{u}`' for u in uses)} |")

    return "\n".join(
        [
            "# Packages",
            "",
            "Generated by `docs/gen_packages.py` (`make docs`) from the import-linter contracts in",
            "`pyproject.toml` and the imports the code makes (grimp); the suite fails when this page",
            "is out of date. An arrow is at least one direct import; an import that a longer path of",
            "arrows already implies is not drawn (the tables below list every one). The apps' order,",
            "top to bottom:",
            " > ".join(f"`{a}`" for a in apps) + ". What each package owns:",
            "[Architecture](architecture.md#jobs-by-concern).",
            "",
            *lines,
            "",
            "## The apps",
            "",
            *apps_table,
            "",
            "## jobs/, package by package",
            "",
            *table,
            "",
        ]
    )


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run `make docs` (docs/gen_packages.py)")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
