"""The package's shape, read from its source with `ast` (nothing is imported): only the CLI
prints, the import graph between lmforge modules has no cycles, and the models do not depend on
what uses them."""

from __future__ import annotations

import ast
import io
import tokenize
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lmforge"
# Files (or path prefixes) whose comments of more than two lines are still to be shortened: the
# rationale goes to the module docstring or docs/, the comment keeps the why. Each entry leaves
# once its files pass.
LONG_COMMENTS_PENDING = (
    "lmforge/cli/compare.py",
    "lmforge/cli/plan.py",
    "lmforge/cli/serve.py",
    "lmforge/inference/",
    "lmforge/parallel/context",
    "lmforge/parallel/mesh.py",
    "lmforge/rl/",
    "lmforge/serve/",
    "lmforge/train/plan",
    "lmforge/train/tasks/grpo.py",
    "lmforge/train/trainer.py",
    "lmforge/train/transforms.py",
)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file; a package is its __init__.py."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The lmforge modules `name` imports, at module level or inside functions (TYPE_CHECKING blocks
    too).

    `from lmforge.x import y` imports lmforge.x.y when that is a module, else lmforge.x (its
    __init__ when a package); `import lmforge.x.y` imports lmforge.x.y.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    out.add(f"{base}.{alias.name}")
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles as chains [a, b, ..., a]: for each strongly connected component (Tarjan),
    the shortest cycle through each of its modules, each cycle once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found, seen = [], set()
    for component in components:
        for start in sorted(component):
            chain = _shortest_cycle(graph, component, start)
            key = frozenset(zip(chain, chain[1:]))
            if key not in seen:
                seen.add(key)
                found.append(chain)
    return found


def _shortest_cycle(graph: dict[str, set[str]], within: set[str], start: str) -> list[str]:
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & within):
            if w == start:
                chain = [v]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def print_calls(root: Path = PACKAGE) -> list[str]:
    """file:line of every print(...) call outside lmforge/cli/."""
    calls = []
    for path in sorted(root.rglob("*.py")):
        if (root / "cli") in path.parents:
            continue
        lines = sorted(
            node.lineno
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
        )
        calls += [f"{path.relative_to(root.parent)}:{line}" for line in lines]
    return calls


def private_imports(root: Path = PACKAGE) -> list[str]:
    """`from lmforge.x import _name` anywhere in the package: a name another module needs is
    public."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith(root.name)
            ):
                found += [
                    f"{path.relative_to(root.parent)}:{node.lineno} imports {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if getattr(d, "id", None) == "dataclass" or getattr(d, "attr", None) == "dataclass":
            return True
    return False


def long_comments(root: Path = PACKAGE, pending: tuple[str, ...] = LONG_COMMENTS_PENDING):
    """file:line of each block of more than two consecutive comment lines inside a function or
    class body, outside `pending`. The comment above a dataclass field may be longer:
    scripts/gen_reference.py reads it into the config reference."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root.parent).as_posix()
        if name.startswith(pending):
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        comments = sorted(
            tok.start[0]
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#")
        )
        bodies, fields = [], set()
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bodies.append((node.lineno, node.end_lineno))
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                fields |= {item.lineno for item in node.body if isinstance(item, ast.AnnAssign)}
        blocks: list[list[int]] = []
        for line in comments:
            if blocks and line == blocks[-1][-1] + 1:
                blocks[-1].append(line)
            else:
                blocks.append([line])
        found += [
            f"{name}:{block[0]}"
            for block in blocks
            if len(block) > 2
            and block[-1] + 1 not in fields
            and any(start <= block[0] <= end for start, end in bodies)
        ]
    return found


def test_comments_in_code_are_at_most_two_lines():
    found = long_comments()
    assert not found, (
        "comments of more than two lines inside a function or class (keep the why in one or two "
        "lines; the longer rationale goes to the module docstring or docs/): " + ", ".join(found)
    )


def test_only_the_cli_prints():
    calls = print_calls()
    assert not calls, (
        "library code logs, only lmforge/cli/ prints (return what the CLI should show): "
        + ", ".join(calls)
    )


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles between lmforge modules:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_no_private_names_cross_modules():
    found = private_imports()
    assert not found, "private names imported from another module: " + ", ".join(found)


def test_models_do_not_import_their_users():
    graph = import_graph()
    users = ("lmforge.inference", "lmforge.serve", "lmforge.cli", "lmforge.train")
    wrong = sorted(
        f"{m} -> {i}"
        for m, deps in graph.items()
        if m.startswith("lmforge.models")
        for i in deps
        if i.startswith(users)
    )
    assert not wrong, "lmforge.models must not import what builds on it: " + ", ".join(wrong)


def task_dispatch(root: Path = PACKAGE) -> list[str]:
    """Places that compare a task's name with a string literal (`task == "sft"`, `cfg.data.task
    != "mlm"`): what differs between tasks belongs to their Task objects (lmforge.train.tasks)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(
                getattr(x, "id", None) == "task" or getattr(x, "attr", None) == "task"
                for x in sides
            )
            literal = any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides)
            if named and literal:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_task_name_dispatch():
    found = task_dispatch()
    assert not found, (
        "task names compared with strings (give the Task object the behaviour): " + ", ".join(found)
    )


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A print, a cycle and a private import planted in a scratch package are found; cycles come
    as chains."""
    pkg = tmp_path / "lmforge"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("print('the CLI may print')\n")
    (pkg / "a.py").write_text("from lmforge import b\n")
    (pkg / "b.py").write_text("def f():\n    from lmforge.c import g\n    print(g)\n")
    (pkg / "c.py").write_text(
        "import lmforge.a\nfrom lmforge.cli import _helper\n\ndef g():\n    pass\n"
    )
    assert print_calls(pkg) == ["lmforge/b.py:3"]
    assert private_imports(pkg) == ["lmforge/c.py:2 imports _helper"]
    assert cycles(import_graph(pkg)) == [["lmforge.a", "lmforge.b", "lmforge.c", "lmforge.a"]]
    (pkg / "a.py").write_text(
        "def f(cfg):\n    return cfg.data.task == 'sft' or 'mlm' != cfg.task\n"
    )
    assert task_dispatch(pkg) == ["lmforge/a.py:2", "lmforge/a.py:2"]
    (pkg / "c.py").write_text("from lmforge import cli\n")
    assert cycles(import_graph(pkg)) == []
    three = "    # one\n    # two\n    # three\n"
    (pkg / "d.py").write_text(
        "# a module's comment\n# may run\n# long\n\n"
        f"def f():\n    # two lines\n    # are fine\n    x = 1\n{three}    return x\n\n\n"
        f"@dataclasses.dataclass\nclass Config:\n{three}    key: int = 0\n\n\n"
        f"class Task:\n{three}    stats: int = 1\n"
    )
    assert long_comments(pkg, pending=("lmforge/cli/",)) == ["lmforge/d.py:9", "lmforge/d.py:24"]
    assert long_comments(pkg, pending=("lmforge/d.py",)) == []
