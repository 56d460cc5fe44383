"""Imports follow the layer order written in docs/design.md ("## Layers").

The table there is the single source: this test parses it (layer number -> module names or globs
such as `data/*`), reads every module's imports with `ast` (lazy imports inside functions too)
and fails naming the importer, the imported module and both layers when a module reaches up.
An exact name wins over a glob (a module can be given a layer other than its folder's). A
package's `__init__` counts as layer 0: importing any submodule runs it, so it must import
nothing of the project. Sentences of the form "`A` and `B` are siblings" in that section forbid
imports between the two groups although they share a layer.
"""
from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mspretrain"
DESIGN = ROOT / "docs" / "design.md"

# Imports against the layers that the house issue is removing while this test lands.
# delete when empty. (importer, imported), as dotted names under mspretrain.
ALLOWED: frozenset[tuple[str, str]] = frozenset()

# Import loops still to break, as the imports (importer, imported) that close
# them. Each needs a module moved that other work owned when this test landed: delete an entry
# with the move that ends its loop (test_known_loops_are_exact fails on a stale one).
KNOWN_LOOPS: frozenset[tuple[str, str]] = frozenset()


def _layers_section(design: Path = DESIGN) -> str:
    text = design.read_text(encoding="utf-8")
    start = text.index("## Layers")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def layer_table(design: Path = DESIGN) -> dict[str, int]:
    """`data/*` or `parallel/layout` -> layer number, from the table rows `| 3 name | `a`, `b/*` | ... |`."""
    table: dict[str, int] = {}
    for line in _layers_section(design).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.match(r"\d+\b", cells[0]):
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            assert name not in table, f"docs/design.md lists {name} in two layers"
            table[name] = int(re.match(r"\d+", cells[0]).group())
    assert table, "docs/design.md has no layer table under '## Layers'"
    return table


def sibling_rules(design: Path = DESIGN) -> list[tuple[str, str]]:
    """Pairs of groups in one layer that must not import each other ("`A` and `B` are siblings")."""
    return re.findall(r"`([\w/*]+)` and `([\w/*]+)` are siblings", " ".join(_layers_section(design).split()))


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """Dotted name under mspretrain (`step.step`, `data`, `` for the root package) -> file."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(pkg).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer_of(module: str, table: dict[str, int], path: Path) -> int | None:
    if path.name == "__init__.py":
        return 0
    slashed = module.replace(".", "/")
    if slashed in table:
        return table[slashed]
    globs = [layer for name, layer in table.items() if "*" in name and fnmatch.fnmatchcase(slashed, name)]
    return min(globs) if globs else None


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `module` imports anywhere in its file, resolved to the modules that exist."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def add(dotted: str) -> None:
        if dotted == "mspretrain" or dotted.startswith("mspretrain."):
            name = dotted[len("mspretrain."):] if dotted != "mspretrain" else ""
            while name not in known and name:  # a name inside a module: keep the module
                name = name.rpartition(".")[0]
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join(["mspretrain", *base] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:  # `from mspretrain.step import step` imports the module step.step
                add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}"[len("mspretrain."):] in known else stem)
    found.discard(module)
    return found


def _edges(pkg: Path = PKG) -> list[tuple[str, str]]:
    mods = modules(pkg)
    return sorted((m, dep) for m, p in mods.items() for dep in imports_of(m, p, set(mods)))


def layer_violations(pkg: Path = PKG, design: Path = DESIGN, allowed: frozenset = ALLOWED) -> list[str]:
    table, mods = layer_table(design), modules(pkg)
    out = []
    for importer, imported in _edges(pkg):
        if (importer, imported) in allowed:
            continue
        low, high = layer_of(importer, table, mods[importer]), layer_of(imported, table, mods[imported])
        if low is not None and high is not None and high > low:
            out.append(f"mspretrain.{importer} (layer {low}) imports mspretrain.{imported} (layer {high})")
    return out


def sibling_violations(pkg: Path = PKG, design: Path = DESIGN, allowed: frozenset = ALLOWED) -> list[str]:
    out = []
    for a, b in sibling_rules(design):
        for importer, imported in _edges(pkg):
            if (importer, imported) in allowed:
                continue
            src, dst = importer.replace(".", "/"), imported.replace(".", "/")
            for x, y in ((a, b), (b, a)):
                if fnmatch.fnmatchcase(src, x) and fnmatch.fnmatchcase(dst, y):
                    out.append(f"mspretrain.{importer} ({x}) imports its sibling mspretrain.{imported} ({y})")
    return out


def package_of(module: str) -> str:
    """`step.step` -> `step`; a top-level module is a package of its own (`budget`)."""
    return module.split(".")[0]


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The import loops of a graph: its strongly connected components of more than one node
    (Tarjan's algorithm), each sorted, in sorted order."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def package_edges(module_edges: list[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(package_of(a), package_of(b)) for a, b in module_edges if package_of(a) != package_of(b)}


def import_loops(pkg: Path = PKG, known: frozenset = frozenset()) -> list[str]:
    """Loops between modules and loops between packages (lazy imports count: they run too), with
    the module imports in `known` left out. A loop is named with the imports that close it."""
    edges = [e for e in _edges(pkg) if e not in known]
    out = []
    for loop in cycles(set(edges)):
        inside = sorted(f"{a} -> {b}" for a, b in edges if a in loop and b in loop)
        out.append(f"modules {' <-> '.join(f'mspretrain.{m}' for m in loop)}: {'; '.join(inside)}")
    for loop in cycles(package_edges(edges)):
        inside = sorted(f"{a} -> {b}" for a, b in edges if package_of(a) in loop and package_of(b) in loop
                        and package_of(a) != package_of(b))
        out.append(f"packages {' <-> '.join(f'mspretrain.{p}' for p in loop)}: {'; '.join(inside)}")
    return out


def test_no_import_loops():
    """No module imports itself through others, and no package does: `forensics` -> `train` -> `forensics`
    is a loop even when no single module closes it. KNOWN_LOOPS lists the imports still to move."""
    bad = import_loops(known=KNOWN_LOOPS)
    assert not bad, "import loops (move the shared part into a module both can import):\n" + "\n".join(bad)


def test_known_loops_are_exact():
    """Each listed import still exists and still closes a loop: delete entries as they are fixed."""
    edges = set(_edges())
    stale = [f"{a} -> {b}: no longer imported" for a, b in sorted(KNOWN_LOOPS) if (a, b) not in edges]
    for a, b in sorted(KNOWN_LOOPS & edges):
        if not import_loops(known=KNOWN_LOOPS - {(a, b)}):
            stale.append(f"{a} -> {b}: closes no loop now")
    assert not stale, "remove from KNOWN_LOOPS in tests/test_layers.py: " + "; ".join(stale)


def test_a_loop_is_named(tmp_path):
    """A made-up package with a module loop (a -> b -> a, b's import lazy) and a package loop
    (p.x -> q.y -> p.z) that no module loop makes."""
    pkg = tmp_path / "mspretrain"
    for d in ("p", "q"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "a.py").write_text("from mspretrain import b\n", encoding="utf-8")
    (pkg / "b.py").write_text("def f():\n    from mspretrain.a import g\n", encoding="utf-8")
    (pkg / "p" / "x.py").write_text("from mspretrain.q import y\n", encoding="utf-8")
    (pkg / "p" / "z.py").write_text("", encoding="utf-8")
    (pkg / "q" / "y.py").write_text("from mspretrain.p import z\n", encoding="utf-8")
    assert cycles({("a", "b"), ("b", "a"), ("b", "c")}) == [["a", "b"]]
    assert import_loops(pkg) == ["modules mspretrain.a <-> mspretrain.b: a -> b; b -> a",
                                 "packages mspretrain.a <-> mspretrain.b: a -> b; b -> a",
                                 "packages mspretrain.p <-> mspretrain.q: p.x -> q.y; q.y -> p.z"]
    assert import_loops(pkg, frozenset({("q.y", "p.z"), ("b", "a")})) == []


def test_no_module_imports_from_a_higher_layer():
    bad = layer_violations()
    assert not bad, "imports against the layer order of docs/design.md:\n" + "\n".join(bad)


def test_siblings_do_not_import_each_other():
    assert ("data/*", "model/*") in sibling_rules()
    bad = sibling_violations()
    assert not bad, "imports between sibling groups (docs/design.md, '## Layers'):\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    table, mods = layer_table(), modules()
    missing = sorted(m for m, p in mods.items() if layer_of(m, table, p) is None)
    assert not missing, f"modules with no layer in docs/design.md's table (add them): {', '.join(missing)}"


def mixed_folders(pkg: Path = PKG, design: Path = DESIGN) -> list[str]:
    """Package folders whose modules sit in more than one layer (or in none): a folder says its layer."""
    table, mods = layer_table(design), modules(pkg)
    layers: dict[str, set[int | None]] = {}
    for m, p in mods.items():
        if p.name != "__init__.py" and "." in m:  # a top-level module is a layer entry of its own
            layers.setdefault(m.rpartition(".")[0].replace(".", "/"), set()).add(layer_of(m, table, p))
    return [f"{folder}/: layers {', '.join(sorted(str(x) for x in ls))}" for folder, ls in sorted(layers.items()) if len(ls) != 1]


def test_every_folder_is_in_one_layer():
    bad = mixed_folders()
    assert not bad, "package folders across layers in docs/design.md's table (move the module, or split the folder):\n" + "\n".join(bad)


# Files over 500 lines still to split: kept exact, so a split must remove its entry and
# no new long file slips in. Paths under mspretrain/.
LONG_FILES: frozenset[str] = frozenset()
MAX_LINES = 500


def test_no_package_file_over_500_lines():
    long = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if len(p.read_text(encoding="utf-8").splitlines()) > MAX_LINES}
    assert not long - LONG_FILES, f"files over {MAX_LINES} lines (split them by subject): {', '.join(sorted(long - LONG_FILES))}"
    assert not LONG_FILES - long, f"remove from LONG_FILES in tests/test_layers.py (now short or gone): {', '.join(sorted(LONG_FILES - long))}"


def test_package_inits_import_nothing_of_the_project():
    mods = modules()
    bad = [f"mspretrain.{m or '__init__'} imports {', '.join(sorted(deps))}" for m, p in mods.items()
           if p.name == "__init__.py" and (deps := imports_of(m, p, set(mods)))]
    assert not bad, "a package's __init__ runs on every import of its modules:\n" + "\n".join(bad)


def test_allow_list_is_exact():
    """Each allowed import still exists and is still against the layers: delete entries as they are fixed."""
    table, mods = layer_table(), modules()
    edges = set(_edges())
    siblings = sibling_rules()
    stale = []
    for importer, imported in sorted(ALLOWED):
        if (importer, imported) not in edges:
            stale.append(f"{importer} -> {imported}: no longer imported")
            continue
        up = (layer_of(imported, table, mods[imported]) or 0) > (layer_of(importer, table, mods[importer]) or 0)
        sib = any(fnmatch.fnmatchcase(importer.replace(".", "/"), x) and fnmatch.fnmatchcase(imported.replace(".", "/"), y)
                  for a, b in siblings for x, y in ((a, b), (b, a)))
        if not (up or sib):
            stale.append(f"{importer} -> {imported}: allowed by the layers now")
    assert not stale, "remove from ALLOWED in tests/test_layers.py: " + "; ".join(stale)


def test_the_checker_finds_what_it_should(tmp_path):
    """The parser and the walker on known cases, so a silent parser cannot pass the tests above."""
    table = layer_table()
    mods = modules()
    assert layer_of("parallel.layout", table, mods["parallel.layout"]) == 1
    assert layer_of("step.step", table, mods["step.step"]) == 3
    assert layer_of("prepare.raypool", table, mods["prepare.raypool"]) == 2
    assert layer_of("b.c", {"b/*": 1, "b/c": 0}, Path("c.py")) == 0  # an exact name over its folder's glob
    assert layer_of("model.decoder", table, mods["model.decoder"]) == 2
    assert layer_of("commands.train", table, mods["commands.train"]) == 6
    assert layer_of("config.schema", table, mods["config.schema"]) == 0
    # a lazy import inside a function, a relative import and a from-package import are all seen
    fake = tmp_path / "fake.py"
    fake.write_text("from mspretrain.config import schema\n"
                    "def f():\n    from mspretrain.step import step\n    import mspretrain.data.loader as ld\n"
                    "from .layout import x\n", encoding="utf-8")
    assert imports_of("parallel.fake", fake, set(mods)) == {"config.schema", "step.step", "data.loader", "parallel.layout"}


def test_a_violation_is_named(tmp_path):
    """A made-up package whose layer-0 module imports upward, lazily, and whose siblings meet."""
    pkg, design = tmp_path / "mspretrain", tmp_path / "design.md"
    (pkg / "b").mkdir(parents=True)
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "a.py").write_text("def f():\n    from mspretrain.b.c import g\n", encoding="utf-8")
    (pkg / "b" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "b" / "c.py").write_text("import mspretrain.a\nfrom mspretrain.d import h\n", encoding="utf-8")
    (pkg / "d.py").write_text("from . import a\n", encoding="utf-8")
    design.write_text("## Layers\n\n| layer | modules |\n|---|---|\n| 0 base | `a` |\n| 1 up | `b/*`, `d` |\n\n"
                      "`b/*` and `d` are\nsiblings.\n\n## Next\n| 9 | `a` |\n", encoding="utf-8")
    assert layer_table(design) == {"a": 0, "b/*": 1, "d": 1}
    assert layer_violations(pkg, design, frozenset()) == ["mspretrain.a (layer 0) imports mspretrain.b.c (layer 1)"]
    assert layer_violations(pkg, design, frozenset({("a", "b.c")})) == []
    assert sibling_violations(pkg, design, frozenset()) == ["mspretrain.b.c (b/*) imports its sibling mspretrain.d (d)"]
    assert mixed_folders(pkg, design) == []
    (pkg / "b" / "e.py").write_text("", encoding="utf-8")
    design.write_text(design.read_text(encoding="utf-8").replace("| 0 base | `a` |", "| 0 base | `a`, `b/e` |"), encoding="utf-8")
    assert mixed_folders(pkg, design) == ["b/: layers 0, 1"]
