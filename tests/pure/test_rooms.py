"""The rooms of the house: every module in one, imports only down, no circle anywhere.

Read from the source with ``ast`` (``TYPE_CHECKING`` and function-level
imports included), so an upward import or a cycle is a red test, not a
reviewer's catch. ``docs/architecture.md`` tells the same story.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import nixl_twisted

PACKAGE = Path(nixl_twisted.__file__).parent

#: The rooms from the ground up: a module may import its own room and those below.
ROOMS: tuple[tuple[str, frozenset[str]], ...] = (
    # What every room may use: the identity, one-shot events, the log observer.
    (
        "ground",
        frozenset(
            {"nixl_twisted", "nixl_twisted.identity", "nixl_twisted.happened", "nixl_twisted.logs"}
        ),
    ),
    ("config", frozenset({"nixl_twisted.config"})),
    ("protocol", frozenset({"nixl_twisted.protocol"})),
    ("backends", frozenset({"nixl_twisted.backends"})),
    ("kv", frozenset({"nixl_twisted.kv"})),
    ("reuse", frozenset({"nixl_twisted.reuse"})),
    ("discovery", frozenset({"nixl_twisted.discovery"})),
    ("observe", frozenset({"nixl_twisted.observe"})),
    ("fleet", frozenset({"nixl_twisted.fleet"})),
    ("admission", frozenset({"nixl_twisted.admission"})),
    ("exchange", frozenset({"nixl_twisted.exchange"})),
    ("web", frozenset({"nixl_twisted.web"})),
    ("run", frozenset({"nixl_twisted.run"})),
    # What users name: the twistd plugin, the demo, the public fakes.
    ("faces", frozenset({"nixl_twisted.tap", "nixl_twisted.demo", "nixl_twisted.testing"})),
)

Graph = Mapping[str, frozenset[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> frozenset[str]:
    """The proxy's modules that ``name`` imports, wherever in it the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    # Of ``a.b.c`` only the whole chain counts, not its ``a.b`` inside.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            # ``import nixl_twisted`` then ``nixl_twisted.web.app.ProxyApp``.
            if _dotted(node).startswith("nixl_twisted."):
                found.add(_longest_module(_dotted(node), known))
        elif isinstance(node, ast.Constant) and _names_a_module(node.value):
            # A module named by a string (``importlib.import_module``, ``namedAny``,
            # ``twistd --logger``): only a whole string, never prose.
            found.add(_longest_module(str(node.value), known))
    return frozenset(found & known - {name})


DOTTED_NAME = re.compile(r"nixl_twisted(\.[A-Za-z_]\w*)+")


def _names_a_module(value: object) -> bool:
    return isinstance(value, str) and DOTTED_NAME.fullmatch(value) is not None


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for an attribute chain on a name; empty for any other expression."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _longest_module(dotted: str, known: set[str]) -> str:
    """The longest leading part of ``dotted`` that is one of the proxy's modules."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in known:
            return ".".join(parts[:cut])
    return dotted


def import_graph() -> dict[str, frozenset[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def room_of(module: str) -> int | None:
    """The height of the module's room (0 is the ground); None: it has none.

    The package itself holds only its ``__init__``: a new module at the top
    must be given a room.
    """
    for height, (_, names) in enumerate(ROOMS):
        for name in names:
            if module == name or (name != "nixl_twisted" and module.startswith(name + ".")):
                return height
    return None


def upward(graph: Graph) -> list[str]:
    """Every import of a room above the importer's own."""
    wrong = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = room_of(module), room_of(other)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{module} -> {other} ({ROOMS[mine][0]} imports {ROOMS[theirs][0]})")
    return wrong


def cycles(graph: Graph) -> list[list[str]]:
    """Each circle of imports, as the modules on it (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def homeless(graph: Graph) -> Iterator[str]:
    return (module for module in sorted(graph) if room_of(module) is None)


def test_every_module_is_in_a_room() -> None:
    assert list(homeless(import_graph())) == []


def test_no_room_imports_a_room_above_it() -> None:
    assert upward(import_graph()) == []


def test_no_circle_of_imports_anywhere() -> None:
    assert cycles(import_graph()) == []


def bench_graph() -> dict[str, frozenset[str]]:
    """The benchmarks' imports of one another (they are scripts, not rooms: no order)."""
    found = {
        "bench" if path.stem == "__init__" else f"bench.{path.stem}": path
        for path in sorted((PACKAGE.parent / "bench").glob("*.py"))
    }
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_no_circle_of_imports_in_the_benchmarks() -> None:
    graph = bench_graph()
    assert "bench.workloads" in graph["bench.replicas_routing"]  # (the graph is read)
    assert cycles(graph) == []


def test_the_graph_is_read_from_every_kind_of_import() -> None:
    graph = import_graph()
    # A TYPE_CHECKING import (metrics reads the pools only for its types).
    assert "nixl_twisted.backends.pools" in graph["nixl_twisted.observe.metrics"]
    # ``from package import module`` is an import of that module.
    assert "nixl_twisted.backends.routing" in graph["nixl_twisted.backends.service"]
    # A relative import, and one inside a function.
    assert "nixl_twisted.testing.fake" in graph["nixl_twisted.testing"]
    assert "nixl_twisted.testing.process" in graph["nixl_twisted.demo"]


def test_a_module_reached_by_attribute_or_by_name_is_an_import_of_it(tmp_path: Path) -> None:
    source = tmp_path / "lowering.py"
    source.write_text(
        "import nixl_twisted\n"
        "import importlib\n"
        "app = nixl_twisted.web.app.ProxyApp\n"
        "site = importlib.import_module('nixl_twisted.web.site')\n"
        "said = 'see nixl_twisted.run.root for how'\n"
    )
    known = set(modules())
    assert imports_of("nixl_twisted.protocol.lowering", source, known) == {
        "nixl_twisted",
        "nixl_twisted.web.app",
        "nixl_twisted.web.site",
    }


def test_the_checks_catch_an_upward_import_a_circle_and_a_stray_module() -> None:
    graph = {
        "nixl_twisted.protocol.lowering": frozenset({"nixl_twisted.web.app"}),
        "nixl_twisted.web.app": frozenset({"nixl_twisted.web.site"}),
        "nixl_twisted.web.site": frozenset({"nixl_twisted.web.app"}),
        "nixl_twisted.helpers": frozenset(),
    }
    assert upward(graph) == [
        "nixl_twisted.protocol.lowering -> nixl_twisted.web.app (protocol imports web)"
    ]
    assert cycles(graph) == [["nixl_twisted.web.app", "nixl_twisted.web.site"]]
    assert list(homeless(graph)) == ["nixl_twisted.helpers"]


def test_the_architecture_doc_tells_the_same_story() -> None:
    """One section per room package, naming every module the package holds."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    sections = dict(
        (match[1], match[2])
        for match in re.finditer(r"^### `(\w+)/`\n(.*?)(?=^#)", doc, re.M | re.S)
    )
    packages = {name for _, names in ROOMS[1:-1] for name in names}
    assert {f"nixl_twisted.{room}" for room in sections} == packages
    for room, text in sections.items():
        held = {p.name for p in (PACKAGE / room).glob("*.py")} - {"__init__.py"}
        assert {name for name in held if f"`{name}`" not in text} == set(), room


#: The packages with a face: the rest of the house imports from each only what its
#: ``__init__.__all__`` exports.
FACED = ("nixl_twisted.config", "nixl_twisted.admission")


def face_of(package: str) -> frozenset[str]:
    """The names a package's ``__init__.py`` lists in ``__all__`` (empty: it has no face)."""
    init = PACKAGE.parent.joinpath(*package.split("."), "__init__.py")
    for node in ast.parse(init.read_text(), str(init)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def behind_the_face(name: str, path: Path, faces: Mapping[str, frozenset[str]]) -> list[str]:
    """Each name ``name`` imports from another package's modules that its face does not
    export (``from a.b import c`` and ``from a import c`` alike: a face is names)."""
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        for package, face in faces.items():
            inside = name == package or name.startswith(package + ".")
            if inside or not (node.module == package or node.module.startswith(package + ".")):
                continue
            wrong += [
                f"{name} imports {node.module}.{alias.name}"
                for alias in node.names
                if alias.name not in face
            ]
    return wrong


def test_every_import_from_another_package_is_of_its_face() -> None:
    faces = {package: face_of(package) for package in FACED}
    assert all(faces.values())
    found = modules()
    assert [
        wrong for name, path in found.items() for wrong in behind_the_face(name, path, faces)
    ] == []


def test_the_face_check_finds_a_name_the_face_does_not_export(tmp_path: Path) -> None:
    source = tmp_path / "app.py"
    source.write_text(
        "from nixl_twisted.admission import Admission\n"
        "from nixl_twisted.admission.fair_queue import FairQueue, Claim\n"
        "from nixl_twisted.admission import gate\n"
    )
    faces = {"nixl_twisted.admission": frozenset({"Admission", "Claim"})}
    assert behind_the_face("nixl_twisted.web.app", source, faces) == [
        "nixl_twisted.web.app imports nixl_twisted.admission.fair_queue.FairQueue",
        "nixl_twisted.web.app imports nixl_twisted.admission.gate",
    ]
    assert behind_the_face("nixl_twisted.admission.slots", source, faces) == []


def scripts_of(path: Path) -> set[str]:
    """The Lua scripts ``path`` defines: upper-case names bound to text that calls Redis
    (``COMMON``, the prelude every script starts with, is no script of its own)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and "redis.call" in ast.unparse(node.value):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper())
    return found - {"COMMON"}


def scripts_named_elsewhere(found: Mapping[str, Path]) -> list[str]:
    """Each use of a script's name outside the module that defines it (imported from it, or
    read as an attribute of it): a script is called through its module's function, with
    named arguments and a typed reply."""
    defined = {name: scripts_of(path) for name, path in found.items()}
    short = {name.rpartition(".")[2]: name for name, scripts in defined.items() if scripts}
    wrong = []
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in defined and node.module != name:
                wrong += [
                    f"{name} names {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name in defined[node.module]
                ]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = short.get(node.value.id)
                if owner not in (None, name) and node.attr in defined[owner]:
                    wrong.append(f"{name} names {owner}.{node.attr}")
    return sorted(set(wrong))


def test_each_redis_script_is_called_only_from_its_own_module() -> None:
    found = modules()
    assert {"PLACE", "RELEASE", "ADMIT", "SHARE"} <= {
        script for path in found.values() for script in scripts_of(path)
    }
    assert scripts_named_elsewhere(found) == []


def test_the_script_check_finds_a_script_named_elsewhere(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts.py"
    scripts.write_text(
        "PLACE = COMMON + \"return redis.call('GET', KEYS[1])\"\n"
        "LEAVE = COMMON + \"return redis.call('DEL', KEYS[1])\"\n"
        "place(PLACE)\n"
    )
    queue = tmp_path / "queue.py"
    queue.write_text(
        "from nixl_twisted.fleet.scripts import PLACE\nreplicas.call(scripts.LEAVE, [], 'x')\n"
    )
    found = {"nixl_twisted.fleet.scripts": scripts, "nixl_twisted.admission.queue": queue}
    assert scripts_named_elsewhere(found) == [
        "nixl_twisted.admission.queue names nixl_twisted.fleet.scripts.LEAVE",
        "nixl_twisted.admission.queue names nixl_twisted.fleet.scripts.PLACE",
    ]


#: The rooms below the door, where a request is the value the door read, never its body.
BELOW_THE_DOOR = ("admission", "exchange", "backends", "web")
#: The door itself: where a client's bytes become that value (``web/door.py``).
DOOR = "nixl_twisted.web.door"
#: Annotations that are a JSON object as parsed.
RAW_BODY = re.compile(r"\bJSONObject\b|\bdict\[str, Any\]|\bMapping\[str, Any\]")


def takes_a_raw_body(path: Path) -> list[str]:
    """Each function of ``path`` that takes a parameter named ``body`` as a parsed JSON object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for argument in arguments:
                annotation = ast.unparse(argument.annotation) if argument.annotation else ""
                if argument.arg == "body" and RAW_BODY.search(annotation):
                    found.append(f"{path.name}:{node.lineno} {node.name}({argument.arg})")
    return found


def test_no_function_below_the_door_takes_the_clients_body() -> None:
    """A request is read once, at the door: below it, readers take the ``Completion``."""
    below = [
        path
        for name, path in modules().items()
        if name.split(".")[1:2] and name.split(".")[1] in BELOW_THE_DOOR and name != DOOR
    ]
    assert below and [found for path in below for found in takes_a_raw_body(path)] == []


def test_the_read_once_check_finds_a_raw_body(tmp_path: Path) -> None:
    source = tmp_path / "legs.py"
    source.write_text(
        "def lowered(body: JSONObject) -> bytes: ...\n"
        "async def sent(path: str, body: dict[str, Any]) -> None: ...\n"
        "def encoded(body: bytes) -> None: ...\n"
    )
    assert takes_a_raw_body(source) == ["legs.py:1 lowered(body)", "legs.py:2 sent(body)"]
