"""The docs name only things that exist, and cite no issue numbers (a reader cannot look them up).

Every inline code span in README.md and docs/*.md that looks like code is checked against the
tree, by the first rule that applies:
- `make T`: a Makefile target; `python -m M`: a module of ours; `python f.py`: a file;
  `hypic SUB`: a subcommand (an add_parser("SUB") of our Python); and every --flag in such a command;
- a call `name(...)` / `a.b.name(...)`: the callee is bound in our Python (def, class, import,
  assignment), unless a builtin or hanging off a module we do not own (`torch.cuda...`);
- `HYPIC_NAME`: spelled in a file of the tree that is not documentation, or a config field's
  variable (env prefix such as "HYPIC_ROUTER_" + FIELD: common/mesh/config.py's rule);
- `--flag`: spelled in such a file, or a config field's flag (--some-name, --no-some-name);
  `HYPIC_X_*` and `--x-*` check a prefix;
- a metric `hypic_...{labels}`: a string literal in our Python, up to the series suffixes
  Prometheus adds (_total, _sum, ...); {a,b} alternatives are expanded;
- a path (a / after a top-level entry of the repository, or a bare name ending in
  .py/.yaml/.yml/.proto/.sh): exists (globs allowed; a module may drop .py; a bare name: some
  file has it); a path .gitignore lists is made at run time and passes;
- a dotted name from one of our packages (`common.mesh.config`, `hypic.Client`): the module
  exists and binds the rest (Class.member for a class); `hypic.v1.X`: X is in protos/;
- `Class.member` with a CamelCase class: a class or proto service of ours with that member;
- a CamelCase or snake_case name (or a _private one): our Python uses it (name, attribute,
  keyword or string), a proto declares it, or a YAML/JSON/TOML file of the tree has it as a word.
A name an f-string builds matches with each {field} standing for any word (f"--{kind}-arg").
Anything else (values, <placeholders>, math, English, attribute chains on variables such as
`plan.seam`) is prose and not checked. Repository paths written in the prose, outside code
spans, must exist as well.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

THIS_FILE = Path(__file__).resolve()
ROOT = THIS_FILE.parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {"__pycache__", "node_modules"}  # and every directory whose name starts with "."
DOC_SUFFIXES = {".md", ".png", ".jpg", ".svg"}
TEXT_SUFFIXES = {".py", ".sh", ".yml", ".yaml", ".toml", ".txt", ".cfg", ".proto", ".json", ".ini"}
METRIC_SUFFIXES = ("_total", "_sum", "_count", "_bucket", "_created")

SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^\s*```")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CALL = re.compile(rf"^({IDENT}(?:\.{IDENT})*)\((.*)\)$")
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
CAMEL = re.compile(r"^[A-Z](?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z])[A-Za-z0-9]+$")
SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+$|^_[a-z][a-z0-9]*$")
WORD = re.compile(r"^[A-Z][a-z]{3,}$")  # Timings, Planner
ALL_CAPS = re.compile(r"^([A-Z][A-Z0-9]*)_[A-Z0-9_]+$")  # TIER_HOST; also GRPC_TRACE (not ours)
FILE_EXTENSIONS = {"mdb", "json", "pem", "key", "crt", "log", "lock", "png", "so"}  # data.mdb
ENV = re.compile(r"^HYPIC_[A-Z0-9_]*\*?$")
FLAG = re.compile(r"^--(?:\[no-\])?[a-z][a-z0-9-]*\*?$")
METRIC = re.compile(r"^hypic_[a-z0-9_{},]*[a-z0-9}]$")
BARE_FILE = re.compile(r"^[\w.*-]+\.(?:py|yaml|yml|proto|sh)$")
PROSE_PATH = re.compile(r"(?<![\w./-])((?:bench|common|docker|deploy|hypic|kernels|models|protos|requirements"
                        r"|scripts|services|tests)/[\w./*-]*[\w*/])")
ISSUE_REF = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/])#\d+\b|/issues/\d+")


@dataclass
class Tree:
    """What the repository holds, read once: files, Python names, flags, variables, metrics."""

    paths: set[str] = field(default_factory=set)  # files and directories, relative, with /
    basenames: set[str] = field(default_factory=set)
    modules: dict[str, Path] = field(default_factory=dict)  # dotted module -> file
    bound: set[str] = field(default_factory=set)  # names a def/class/import/assignment binds
    used: set[str] = field(default_factory=set)  # bound + every name, attribute, keyword, string
    strings: set[str] = field(default_factory=set)  # string literals in our Python
    templates: set[str] = field(default_factory=set)  # f-strings as regexes
    ignored: set[str] = field(default_factory=set)  # .gitignore's entries: made at run time
    members: dict[str, set[str]] = field(default_factory=dict)  # class -> its members
    fields: set[str] = field(default_factory=set)  # annotated class attributes (config fields)
    flags: set[str] = field(default_factory=set)
    envs: set[str] = field(default_factory=set)
    make_targets: set[str] = field(default_factory=set)
    subcommands: set[str] = field(default_factory=set)
    proto_names: set[str] = field(default_factory=set)
    enum_prefixes: set[str] = field(default_factory=set)  # TIER_, SOURCE_: the first word + _


def _walk(root: Path):
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path.name in SKIP_DIRS or path == THIS_FILE:
            continue  # this file spells absent names on purpose (the rules' own tests)
        yield path
        if path.is_dir() and not path.is_symlink():
            yield from _walk(path)


def _read_python(tree: Tree, path: Path) -> None:
    """Names bound at any level, names used, string literals, and class members of one file."""
    try:
        source = path.read_text(encoding="utf-8")
        module = ast.parse(source, filename=str(path))
    except (SyntaxError, UnicodeDecodeError):
        return
    tree.subcommands.update(re.findall(r"add_parser\(\s*\"([\w-]+)\"", source))  # hypic up, ...
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            tree.bound.add(node.name)
        if isinstance(node, ast.ClassDef):
            members = tree.members.setdefault(node.name, set())
            for item in ast.walk(node):
                members.update(_bound_by(item))
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    tree.fields.add(item.target.id)
        tree.bound.update(_bound_by(node))
        if isinstance(node, ast.Name):
            tree.used.add(node.id)
        elif isinstance(node, ast.Attribute):
            tree.used.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            tree.used.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            tree.strings.add(node.value)
        elif isinstance(node, ast.JoinedStr) and (template := _template(node)):
            tree.templates.add(template)


def _template(node: ast.JoinedStr) -> str | None:
    """An f-string that builds a flag, variable or metric name, as a regex: each {field} stands
    for any word (f"--{kind}-arg"). None unless it starts with "--", "HYPIC_" or "hypic_" and
    has a literal word besides that prefix (f"--{name}" would match every flag)."""
    literal = "".join(p.value for p in node.values if isinstance(p, ast.Constant))
    prefix = next((p for p in ("--", "HYPIC_", "hypic_") if literal.startswith(p)), None)
    first = node.values[0] if node.values else None
    if not prefix or not isinstance(first, ast.Constant) or not first.value.startswith(prefix) \
            or not re.search(r"[A-Za-z]", literal[len(prefix):]):
        return None
    return "".join(re.escape(part.value) if isinstance(part, ast.Constant) else r"[\w-]+"
                   for part in node.values)


def _bound_by(node: ast.AST) -> set[str]:
    """The names one statement or definition binds (targets, imports, parameters, methods)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names = {node.name}
        if not isinstance(node, ast.ClassDef):
            args = node.args
            names.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
        return names
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {n.split(".")[-1] for a in node.names for n in (a.name, a.asname) if n}
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return {sub.id if isinstance(sub, ast.Name) else sub.attr for target in targets
            for sub in ast.walk(target) if isinstance(sub, (ast.Name, ast.Attribute))}


def _read_proto(tree: Tree, text: str) -> None:
    tree.proto_names.update(re.findall(r"\b(?:message|service|enum|rpc)\s+(\w+)", text))
    tree.proto_names.update(re.findall(r"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+",
                                       text, flags=re.M))
    values = re.findall(r"^\s*([A-Z][A-Z0-9_]*)\s*=\s*\d+\s*;", text, flags=re.M)
    tree.proto_names.update(values)
    tree.enum_prefixes.update(value.split("_")[0] + "_" for value in values if "_" in value)
    for service, body in re.findall(r"service\s+(\w+)\s*\{(.*?)\n\}", text, flags=re.S):
        tree.members.setdefault(service, set()).update(re.findall(r"\brpc\s+(\w+)", body))


@functools.lru_cache(maxsize=1)
def read_tree() -> Tree:
    tree = Tree()
    texts: list[str] = []
    for path in _walk(ROOT):
        rel = path.relative_to(ROOT)
        tree.paths.add(rel.as_posix())
        tree.basenames.add(path.name)
        if path.is_dir() or path.suffix in DOC_SUFFIXES:
            continue
        if path.suffix == ".py":
            tree.modules[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
            _read_python(tree, path)
        elif path.suffix in TEXT_SUFFIXES or path.name.startswith(("Makefile", "Dockerfile")) \
                or (path.suffix == "" and path.stat().st_size < 1 << 20):
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
            if path.suffix == ".proto":
                _read_proto(tree, texts[-1])
    tree.bound |= tree.proto_names
    tree.used |= tree.bound | {s for s in tree.strings if re.fullmatch(IDENT, s)}
    tree.used |= set(re.findall(IDENT, "\n".join(texts)))  # config keys in YAML, JSON, TOML
    gitignore = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    tree.ignored = {line.strip("/") for line in gitignore if line and not line.startswith("#")}
    _derive_flags_and_envs(tree, "\n".join(texts))
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    tree.make_targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
    return tree


def _derive_flags_and_envs(tree: Tree, text: str) -> None:
    """Flags and variables spelled in the tree, plus those common/mesh/config.py derives from
    every config field: --some-name, --no-some-name, and each env prefix + SOME_NAME."""
    text += "\n".join(tree.strings)
    tree.flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    tree.flags |= {f"--{name.replace('_', '-')}" for name in tree.fields}
    tree.flags |= {f"--no-{flag[2:]}" for flag in tree.flags}
    tree.envs = set(re.findall(r"\bHYPIC_[A-Z0-9_]*[A-Z0-9]\b", text))
    prefixes = set(re.findall(r"\bHYPIC_(?:[A-Z0-9]+_)*", text))
    tree.envs |= {p + name.upper() for p in prefixes for name in tree.fields if p.endswith("_")}


# ---------------------------------------------------------------- one rule per kind of span


def _check_command(tree: Tree, words: list[str]) -> str | None:
    """`make T`, `python -m M`, `python file.py`, `hypic SUB`; their --flags. None: fine."""
    program, rest = words[0], words[1:]
    if re.search(r"[<>…]", " ".join(rest[:2])):
        return None  # `python -m services.<name>`: a placeholder
    problems = []
    if program == "make" and rest and rest[0] not in tree.make_targets:
        problems.append(f"`make {rest[0]}`: no such target in the Makefile")
    if program == "python" and rest[:1] == ["-m"] and len(rest) > 1:
        module = rest[1]
        if module.split(".")[0] not in tree.modules:
            return None
        if module not in tree.modules and f"{module}.__main__" not in tree.modules:
            problems.append(f"`python -m {module}`: no module {module} in the tree")
    elif program == "python" and rest and rest[0].endswith(".py") and rest[0] not in tree.paths:
        problems.append(f"`python {rest[0]}`: no such file")
    if program == "hypic" and rest and rest[0][:1] != "-" and rest[0] not in tree.subcommands:
        problems.append(f"`hypic {rest[0]}`: no add_parser(\"{rest[0]}\") in our Python")
    for word in rest:
        flag = word.split("=", 1)[0]
        if FLAG.match(flag) and (problem := _check_flag(tree, flag)):
            problems.append(problem)
    return "; ".join(problems) or None


def _check_call(tree: Tree, callee: str) -> str | None:
    parts = callee.split(".")
    name = parts[-1]
    if len(parts) == 1 and (hasattr(builtins, name) or len(name) == 1):
        return None  # a builtin such as min(), or a one-letter name in a formula
    if len(parts) > 1 and parts[0] not in tree.modules and _external_module(parts[0]):
        return None  # torch.cuda.is_available() and the like: not ours to check
    if parts[0] in tree.modules:
        return _check_dotted(tree, callee)
    if name not in tree.bound:
        return f"`{name}(...)`: no def, class or import binds {name} in our Python"
    return None


@functools.lru_cache(maxsize=None)
def _external_module(root: str) -> bool:
    try:
        return importlib.util.find_spec(root) is not None
    except (ImportError, ValueError):
        return False


def _check_known(tree: Tree, name: str, known: set[str], why: str) -> str | None:
    """`name` is in `known` or built by an f-string; `X_*`, `--x-*`, `X_`: some known name starts so."""
    prefix = name.rstrip("*")
    if name.endswith(("*", "_")):
        return None if any(k.startswith(prefix) for k in known) else f"`{name}`: nothing known starts with {prefix}"
    return None if name in known or _templated(tree, name) else f"`{name}`: {why}"


def _check_env(tree: Tree, name: str) -> str | None:
    return _check_known(tree, name, tree.envs, "no file of the tree spells it and no config field "
                        "derives it (env prefix + FIELD_NAME)")


def _check_flag(tree: Tree, flag: str) -> str | None:
    return _check_known(tree, flag.replace("[no-]", ""), tree.flags | {"--help"},
                        "no argparse string, script or config field (some_name -> --some-name) defines it")


def _templated(tree: Tree, name: str) -> bool:
    return any(re.fullmatch(template, name) for template in tree.templates)


def _expand_braces(name: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", name)
    if not match:
        return [name]
    return [expanded for alternative in match.group(1).split(",")
            for expanded in _expand_braces(name[:match.start()] + alternative.strip()
                                           + name[match.end():])]


def _check_metric(tree: Tree, span: str) -> str | None:
    base = re.sub(r"\{[^{}]*\}$", "", span)  # the labels
    for name in _expand_braces(base):
        stems = {name} | {name[: -len(s)] for s in METRIC_SUFFIXES if name.endswith(s)}
        if not stems & tree.strings and not any(_templated(tree, s) for s in stems):
            return f"`{name}`: no metric of that name is registered (a string literal in our Python)"
    return None


def _check_path(tree: Tree, span: str) -> str | None:
    path = span.rstrip("/")
    if "*" in path:
        if not any(ROOT.glob(path)):
            return f"`{span}`: the glob matches nothing"
        return None
    if any(path == entry or path.startswith(entry + "/") for entry in tree.ignored):
        return None  # git-ignored: made at run time or by hand, never committed
    if "/" in path:
        if path not in tree.paths and f"{path}.py" not in tree.paths:  # bench/serve: a module
            return f"`{span}`: no such file or directory"
    elif path not in tree.basenames:
        return f"`{span}`: no file of that name anywhere in the tree"
    return None


def _is_path(tree: Tree, span: str) -> bool:
    """A path: has a / after a top-level entry of the repository, or is a bare file name."""
    if re.search(r"[\s<>:…]", span):
        return False
    if "/" in span:
        return span.split("/", 1)[0] in tree.paths
    return bool(BARE_FILE.match(span))


@functools.lru_cache(maxsize=None)
def _module_names(path: Path) -> frozenset[str]:
    """The names a module binds at its top level (defs, classes, imports, assignments)."""
    module = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in module.body:
        names |= _bound_by(node)
        if isinstance(node, (ast.If, ast.Try)):  # guarded imports and definitions
            for sub in ast.walk(node):
                names |= _bound_by(sub)
    return frozenset(names)


def _check_dotted(tree: Tree, span: str) -> str | None:
    """`common.mesh.config`, `hypic.Client`, `hypic.launcher.Mesh`, `hypic.v1.Router`."""
    parts = span.split(".")
    if parts[:2] == ["hypic", "v1"]:
        missing = [p for p in parts[2:] if p not in tree.proto_names]
        return f"`{span}`: protos/ define no {missing[0]}" if missing else None
    cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in tree.modules)
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return None
    if rest[0] not in _module_names(tree.modules[module]):
        return f"`{span}`: module {module} ({tree.modules[module].relative_to(ROOT)}) binds no {rest[0]}"
    if len(rest) > 1:
        return _check_member(tree, rest[0], rest[1], span)
    return None


def _check_member(tree: Tree, owner: str, member: str, span: str) -> str | None:
    if owner not in tree.members:
        return f"`{span}`: no class or proto service {owner} in the tree"
    if member not in tree.members[owner]:
        return f"`{span}`: class {owner} has no member {member}"
    return None


def problem_with(tree: Tree, span: str) -> str | None:
    """What is wrong with one code span, or None when it exists or is not code (rules above)."""
    span = span.strip()
    words = span.split() or [""]
    if words[0] in {"make", "python", "hypic"} and len(words) > 1:
        return _check_command(tree, words)
    if call := CALL.match(span):
        return _check_call(tree, call.group(1))
    name = words[0].split("=", 1)[0]  # `HYPIC_X=1`, `--flag=value`, `--flag VALUE`
    if ENV.match(name):
        return _check_env(tree, name)
    if "/--" in name or FLAG.match(name):
        flags = [f.split("=")[0] for w in words for f in w.strip('"').split("/") if FLAG.match(f.split("=")[0])]
        return next(filter(None, (_check_flag(tree, f) for f in flags)), None)
    if span in METRIC_SUFFIXES:
        return None  # `_total`, `_sum`: the series suffixes Prometheus adds, not our names
    if METRIC.match(re.sub(r"\{[^{}]*\}$", "", span)):
        return _check_metric(tree, span)
    if _is_path(tree, span):
        return _check_path(tree, span)
    if DOTTED.match(span):
        return _check_dotted_span(tree, span)
    if len(words) > 1:
        return None  # a formula or a sentence
    if (caps := ALL_CAPS.match(name)) and caps.group(1) + "_" in tree.enum_prefixes \
            and name not in tree.proto_names:
        return f"`{name}`: no enum value of that name in protos/ (others start with {caps.group(1)}_)"
    if (CAMEL.match(name) or SNAKE.match(name) or WORD.match(name)) and name not in tree.used:
        return (f"`{name}`: our code never uses this name (as a name, attribute, keyword or string), "
                "no proto declares it and no config file of the tree has it")
    return None


def _check_dotted_span(tree: Tree, span: str) -> str | None:
    root, *rest = span.split(".")
    if root in tree.modules:
        return _check_dotted(tree, span)
    if CAMEL.match(root) or (root[:1].isupper() and root in tree.members):
        return _check_member(tree, root, rest[0], span)
    if not _external_module(root) and rest[-1] not in tree.used | FILE_EXTENSIONS:
        return f"`{span}`: our code uses no attribute {rest[-1]}"
    return None  # an attribute of another library's module (grpc.health.v1)


# ---------------------------------------------------------------- the tests


def code_spans(text: str):
    """(line number, span) for every inline code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for span in SPAN.findall(line):
                yield number, span


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_code_span_names_something_that_exists(doc: Path) -> None:
    tree = read_tree()
    rel = doc.relative_to(ROOT).as_posix()
    problems = [f"{rel}:{number}: {problem}" for number, span in code_spans(doc.read_text(encoding="utf-8"))
                if (problem := problem_with(tree, span))]
    assert not problems, ("the doc names things the tree does not have (renamed or removed? "
                          "fix the doc; the rules are in tests/test_docs.py's docstring):\n"
                          + "\n".join(problems))


def prose_paths(text: str):
    """(line number, path) for repository paths written outside code spans and link targets."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose = re.sub(r"\]\([^)]*\)", "]", SPAN.sub(" ", line))
            for path in PROSE_PATH.findall(prose):
                yield number, path


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_in_the_prose_exists(doc: Path) -> None:
    """Paths written without backticks (tests/test_x.py, common/mesh/discovery.py) too."""
    tree = read_tree()
    rel = doc.relative_to(ROOT).as_posix()
    problems = [f"{rel}:{number}: {problem}" for number, path in prose_paths(doc.read_text(encoding="utf-8"))
                if (problem := _check_path(tree, path))]
    assert not problems, "the doc names paths the tree does not have (moved? fix the doc):\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_issue_numbers(doc: Path) -> None:
    rel = doc.relative_to(ROOT).as_posix()
    found = [f"{rel}:{number}: {match.group(0)!r}"
             for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
             for match in ISSUE_REF.finditer(line)]
    assert not found, "a reader cannot look up issue numbers; say what the issue said:\n" + "\n".join(found)


NAMED_BUT_ABSENT = [
    "compose_states", "no_such_helper(x, y)", "NoSuchServicer", "--no-such-flag",
    "HYPIC_ROUTER_NO_SUCH_FIELD", "HYPIC_NOWHERE_*", "hypic_router_no_such_total{code}",
    "common/mesh/no_such.py", "no_such_module.py", "common.mesh.no_such", "hypic.launcher.NoSuch",
    "hypic.v1.NoSuchService", "Planner.no_such_method", "make no-such-target",
    "python -m bench.no_such", "hypic no-such-command", "hypic up --no-such-flag", "TIER_NOWHERE",
    "--policy nowhere --no-such-flag", "hypic_router_no_such{what=\"x\",reason}", "plan.no_such_field",
    "Nowhereclass",
]
NAMED_AND_PRESENT = [
    "compose_run", "prefill_segments(mode=\"hypic\")", "SegmentEntry", "--host-bytes",
    "--no-write-through", "--router-arg", "HYPIC_ROUTER_MAX_IN_FLIGHT", "HYPIC_TLS_*",
    "hypic_router_requests_total{mode,code}", "hypic_segcache_{hits,misses}_total{tier}",
    "common/mesh/config.py", "deploy/k8s/", "server.py", "common.mesh.config", "hypic.launcher.Mesh",
    "hypic.v1.Segcache", "Planner.assign", "make test", "python -m bench.serve", "hypic up --tls",
    "docker/local/", "min(a, b)", "torch.cuda.is_available()", "TIER_HOST", "GRPC_TRACE",
    "--policy gdsf", "hypic_combine_fallbacks_total{what=\"segcache\",reason}", "plan.seam",
    "data.mdb", "Timings", "grpc.health.v1", "T_C = A_1 A_2",
]


@pytest.mark.parametrize("span", NAMED_BUT_ABSENT)
def test_the_rules_catch_a_name_the_tree_lacks(span: str) -> None:
    assert problem_with(read_tree(), span), f"`{span}` names nothing in the tree, yet passed"


@pytest.mark.parametrize("span", NAMED_AND_PRESENT)
def test_the_rules_pass_a_name_the_tree_has(span: str) -> None:
    assert problem_with(read_tree(), span) is None
