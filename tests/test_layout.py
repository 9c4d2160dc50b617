"""The package's layout: no import cycle between sinkax's modules, no module too long, and
project metadata that builds cleanly."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sinkax"
MAX_LINES = 350


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of ``package`` by dotted name (a package by its own name)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The ``known`` modules ``tree`` imports at run time: at module level or inside functions,
    not under ``if TYPE_CHECKING:``. ``from p import x`` imports the module ``p.x`` when there is
    one, else ``p`` itself."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & known


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    files = modules(package)
    return {
        name: imported(ast.parse(path.read_text()), set(files)) - {name}
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules along it (the first repeated last), or ``None``."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*on_path[on_path.index(nxt) :], nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        done.add(on_path.pop())
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def long_modules(package: pathlib.Path, limit: int) -> dict[str, int]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules(package).items()}
    return {name: n for name, n in lengths.items() if n > limit}


def test_no_sinkax_module_imports_one_that_imports_it_back():
    graph = import_graph(PACKAGE)
    assert "sinkax.channel.cursor" in graph["sinkax.sink"]  # the graph sees the real imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_sinkax_module_is_longer_than_the_limit():
    assert not long_modules(PACKAGE, MAX_LINES), f"modules over {MAX_LINES} lines"


def test_the_checks_find_a_cycle_and_a_long_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")  # inside a function
    (package / "b.py").write_text("from pkg.a import f\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    graph = import_graph(package)
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert graph["pkg.c"] == set()  # type-checking imports run nothing
    assert long_modules(package, limit=2) == {"pkg.c": 3}


def test_the_license_is_an_spdx_expression_that_setuptools_takes_without_warning():
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    # a `license = {text = ...}` table is deprecated since setuptools 77 (PEP 639), which warns
    # twice on every install; the SPDX string needs setuptools >= 77 to build
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]


def test_the_train_layer_runs_on_the_public_sink_api():
    # non-sink mode is a Sink too: no second copy of the core's call sequence in train/
    graph = import_graph(PACKAGE)
    core = ("sinkax.execution", "sinkax.interrupt", "sinkax.placement", "sinkax.channel.")
    reached = {
        (module, dep)
        for module, deps in graph.items()
        if module.startswith("sinkax.train")
        for dep in deps
        # (the public values: a dataset's length and position, sinkax.DataPosition)
        if dep.startswith(core) and dep not in ("sinkax.channel.source", "sinkax.channel.position")
    }
    assert not reached, "train/ reaches into the core"
