"""The layering, checked on the import statements themselves (parsed with `ast`, so comments,
strings and docstrings never count, and imports inside functions do):

- a service imports no other service and not the SDK (`hypic`): services meet through protos/ --
  except the OpenAI front, which is the router's client and reaches it through the SDK exactly as a
  user's application would (CLIENT_SERVICES);
- kernels/ imports nothing of ours;
- the packages stand in layers, services -> mesh -> engine -> kernels: common/engine imports nothing
  of ours but kernels/; common/mesh uses of the engine only its pure-Python rules (fingerprint,
  checksum, modes, dtypes) and never loads a model; neither imports a service, the SDK or bench/;
- the SDK imports nothing of bench/, services/, common/ or kernels/;
- common/ has no import cycle (lazy imports inside functions count too);
- the engine (common/engine, kernels), and everything
  of ours it imports, imports nothing that opens a socket or a database.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("bench", "common", "hypic", "kernels", "protos", "services", "tests")
ENGINE = ("common/engine", "kernels")
# What the mesh runtime may use of the engine: rules, not the model.
ENGINE_RULES = ("common.engine.fingerprint", "common.engine.checksum", "common.engine.modes",
                "common.engine.dtypes")
NETWORKED = ("aiohttp", "ftplib", "grpc", "grpc_health", "grpc_tools", "http", "httpx", "lmdb", "nixl",
           "prometheus_client", "requests", "smtplib", "socket", "socketserver", "ssl", "urllib",
           "urllib3", "uvloop", "websockets", "xmlrpc", "zmq", "common.mesh", "services", "protos")


def python_files(under: str = "") -> list[Path]:
    top = ROOT / under
    if top.is_file():
        return [top]
    return sorted(p for p in top.rglob("*.py")
                  if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_import(call: ast.Call) -> str | None:
    """The module named by `importlib.import_module("x.y")` / `import_module(f"x.{k}")`: its
    constant leading part (an f-string's first piece, cut at its last dot)."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rsplit(".", 1)[0] or None
    return None


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module the file `path` imports."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    return imports_in(path.read_text(), package, str(path))


def imports_in(source: str, package: str, filename: str = "<source>") -> frozenset[str]:
    """Every module `source` (a file of `package`) imports, absolute (relative imports resolved),
    anywhere in it; `from a import b` yields a and a.b (b may be a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and (name := _dynamic_import(node)):
            out.add(name)
    return frozenset(out)


def file_of(module: str) -> Path | None:
    """Our source file of `module`, or None (third-party, stdlib, or a name inside a module)."""
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def loaded_by(module: str) -> list[Path]:
    """The files of ours that `import module` runs: its packages' __init__s and itself."""
    parts = module.split(".")
    files = (file_of(".".join(parts[:i])) for i in range(1, len(parts) + 1))
    return [f for f in files if f is not None]


def within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(files: list[Path], forbidden) -> list[str]:
    return [f"{f.relative_to(ROOT)} imports {m}" for f in files for m in sorted(imports_of(f))
            if within(m, forbidden)]


def test_the_walker_sees_real_imports() -> None:
    """Plain, from-, relative, nested and dynamic imports count; strings and comments do not."""
    source = """
import grpc, os.path as p
from . import store
from ..mesh import server
# import lmdb
def f(kind):
    import socket
    importlib.import_module(f"services.{kind}.config")
    return "import nixl"
"""
    assert imports_in(source, "common.x") == {
        "grpc", "os.path", "common.x", "common.x.store", "common.mesh", "common.mesh.server", "socket",
        "services"}
    assert "services.segcache.store" in imports_of(ROOT / "services/segcache/servicer.py")
    assert not within("commonx", ["common"]) and within("common.engine.pic.entry", ["common.engine.pic"])
    assert [p.relative_to(ROOT).as_posix() for p in loaded_by("common.engine.pic.entry")] == [
        "common/__init__.py", "common/engine/__init__.py", "common/engine/pic/__init__.py",
        "common/engine/pic/entry.py"]


CLIENT_SERVICES = {"front"}  # clients of the router: they may use the SDK, never another service


@pytest.mark.parametrize("service", sorted(p.name for p in (ROOT / "services").iterdir()
                                           if (p / "__init__.py").is_file()))
def test_a_service_imports_no_other_service_nor_the_sdk(service: str) -> None:
    others = [f"services.{p.name}" for p in (ROOT / "services").iterdir()
              if p.is_dir() and p.name != service]
    sdk = [] if service in CLIENT_SERVICES else ["hypic"]
    assert violations(python_files(f"services/{service}"), [*others, *sdk]) == []


def test_kernels_import_nothing_of_ours() -> None:
    assert violations(python_files("kernels"), [p for p in OURS if p != "kernels"]) == []


def test_common_imports_no_service_nor_the_sdk() -> None:
    assert violations(python_files("common"), ["services", "hypic", "bench", "tests"]) == []


def test_the_engine_imports_nothing_of_ours_but_kernels() -> None:
    assert violations(python_files("common/engine"), ["common.mesh", "protos"]) == []
    assert all(within(m, ["common.engine", "kernels"]) for f in python_files("common/engine")
               for m in imports_of(f) if within(m, OURS + ("common",)))


def test_the_mesh_uses_only_the_engines_rules() -> None:
    """The shared runtime never loads a model (scatter and combine do) nor calls kernels."""
    used = {m for f in python_files("common/mesh") for m in imports_of(f) if within(m, ["common.engine"])}
    assert used and all(within(m, ENGINE_RULES) for m in used), sorted(used)
    assert violations(python_files("common/mesh"), ["kernels"]) == []


def test_the_sdk_imports_no_bench_service_nor_engine() -> None:
    assert violations(python_files("hypic"), ["bench", "services", "common", "kernels", "tests"]) == []


def engine_closure() -> list[Path]:
    """The engine's files and every file of ours they import, transitively."""
    seen: set[Path] = set()
    todo = [f for under in ENGINE for f in python_files(under)]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo.extend(g for m in imports_of(f) for g in loaded_by(m) if g not in seen)
    return sorted(seen)


def test_the_engine_opens_no_socket() -> None:
    closure = engine_closure()
    assert ROOT / "common/engine/pic/entry.py" in closure and ROOT / "kernels/__init__.py" in closure
    assert violations(closure, NETWORKED) == []


def import_graph(files: list[Path]) -> dict[str, list[str]]:
    """file -> the files among `files` it imports (paths relative to the root)."""
    names = {f: f.relative_to(ROOT).as_posix() for f in files}
    return {names[f]: sorted({names[g] for m in imports_of(f) if (g := file_of(m)) in names} - {names[f]})
            for f in files}


def import_cycle(graph: dict[str, list[str]]) -> list[str]:
    """One cycle of `graph` (first node = last), or [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(f: str) -> list[str]:
        state[f] = "open"
        stack.append(f)
        for g in graph[f]:
            if state.get(g) == "open":
                return stack[stack.index(g):] + [g]
            if g not in state and (found := visit(g)):
                return found
        stack.pop()
        state[f] = "done"
        return []

    for f in graph:
        if f not in state and (found := visit(f)):
            return found
    return []


def test_common_has_no_import_cycle() -> None:
    graph = import_graph(python_files("common"))
    assert "common/engine/pic/__init__.py" in graph["common/engine/hybrid_engine.py"]
    assert import_cycle(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert import_cycle({"a": ["b"], "b": ["c"], "c": [], "d": ["a", "c"]}) == []
    assert import_cycle({"a": ["b"], "b": ["c"], "c": ["b"], "d": ["a"]}) == ["b", "c", "b"]
