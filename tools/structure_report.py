"""Structure figures of ``src/snapkeep``: the measures issue 17 tracks, before and after a change.

    python tools/structure_report.py [--src DIR] [--json] [--no-trace]

What it prints (each figure with the list behind it):

a. **Re-exports.** A module re-exports a name when it imports it from another snapkeep module and
   never uses it itself (only in ``__all__`` or nowhere). The headline counts *private* modules
   (a dotted component starting with ``_``, package ``__init__`` files apart) that re-export at
   least one name; "pure shims" are those with nothing but imports, ``__all__`` and a docstring.
   Public facades (``snapkeep.store``, ``snapkeep.retention``, ...) and package ``__init__``
   files are listed apart: re-exporting is their job.
b. **Cross-module private imports.** ``from M import _x`` in a module other than ``M`` (anywhere
   in the file, function bodies included), split into private *names* (functions, classes,
   values: the headline) and private *submodules* (``from pkg import _mod``). Also the reaches
   into another object's private attribute (``writer._saver``: an attribute ``_x`` that some
   snapkeep class assigns as ``self._x``, read on anything but ``self``/``cls``), and how many
   of them are outside a class that assigns that attribute itself (``other._x`` in a method of
   ``other``'s own class, such as a ``merge(other)``, is the class's own business; each of
   those outside it is listed).
c. **Import cycles** among snapkeep modules, on module-level imports only: imports inside
   functions and under ``if TYPE_CHECKING:`` are excluded (they do not run at import time), and
   so are the implicit imports of parent packages. Counted as strongly connected components and
   as elementary cycles (networkx), on two graphs: *strict* (``from pkg import sub`` is an edge
   to ``pkg.sub`` only: Python needs just the partly initialised parent) and *with package
   edges* (also to ``pkg``, as simpler tools draw it).
d. **Files a save and a resume pass through**, for the manager's door and the Checkpointer,
   traced (``sys.setprofile`` and ``threading.setprofile`` call events) on a real tiny run:
   snapkeep's ``ExtensionsManager`` with a ``ThreadWriter`` and ``extensions.snapshot()`` every
   iteration. *Save*: the snapshot extension's ``__call__`` (trainer thread) of the second
   snapshot, plus every snapkeep frame on other threads until that snapshot is committed.
   *Resume*: the snapshot extension's ``initialize`` (autoload) in a fresh manager over the same
   directory. Also the whole iteration around each. Distinct ``src/snapkeep`` files with at
   least one call event.
e. **Copies of verify / newest-valid-with-fallback / delete**, by a heuristic over function
   bodies (not a hand-maintained list; the matches are printed so a reader can judge):
   verify = computes a digest (calls a ``*digest*``/``hash_file`` function) and compares it with
   a recorded checksum (``require_match`` or a comparison naming ``checksum``); fallback = a loop
   over snapshots newest first (``reversed(...)`` or ``sorted(..., reverse=True)``, directly or
   through a local name) that ``return``s from inside the loop; delete = removes a snapshot and
   its manifest or marker as one operation: names ``manifest_path``/``*marker*`` and removes
   (``.remove``/``.rm``/``.rm_file``/``.unlink``) twice, in a loop, or beside ``remove_marker``.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- modules ----------------------------------------------------------------------------------
class Module:
    def __init__(self, name: str, path: pathlib.Path) -> None:
        self.name = name
        self.path = path
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.is_package = path.name == "__init__.py"

    @property
    def private(self) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in self.name.split("."))

    def resolve(self, node: ast.ImportFrom) -> str:
        """The absolute module of a (possibly relative) ``from`` import."""
        if not node.level:
            return node.module or ""
        base = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))


def load_modules(src: pathlib.Path) -> dict[str, Module]:
    out = {}
    for path in sorted((src / "snapkeep").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = Module(".".join(parts), path)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(module: Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run at import time: top level, inside top-level try/if (not TYPE_CHECKING)."""
    stack: list[ast.stmt] = list(module.tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            stack = list(node.body) + list(node.orelse) + stack
        elif isinstance(node, ast.Try):
            stack = list(node.body) + [s for h in node.handlers for s in h.body] \
                + list(node.orelse) + list(node.finalbody) + stack


# -- a. re-exports ----------------------------------------------------------------------------
def _used_names(module: Module) -> set[str]:
    used: set[str] = set()
    for node in module.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                used.add(sub.id)
            annotation = getattr(sub, "annotation", None) or getattr(sub, "returns", None)
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                try:
                    used |= {n.id for n in ast.walk(ast.parse(annotation.value))
                             if isinstance(n, ast.Name)}
                except SyntaxError:
                    pass
    return used


def re_exports(modules: dict[str, Module]) -> dict[str, Any]:
    rows = []
    for module in modules.values():
        used = _used_names(module)
        names = []
        for node in module_level_imports(module):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = module.resolve(node)
            if not source.startswith("snapkeep"):
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if f"{source}.{alias.name}" in modules or local in used:
                    continue  # a submodule, or a name the module uses
                names.append(f"{source}.{alias.name}")
        if not names:
            continue
        body = [n for n in module.tree.body if not (
            isinstance(n, (ast.Import, ast.ImportFrom))
            or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            or (isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)))]
        kind = ("package" if module.is_package
                else "private" if module.private else "public")
        rows.append({"module": module.name, "kind": kind, "pure_shim": not body,
                     "names": len(names), "examples": names[:3]})
    private = [r for r in rows if r["kind"] == "private"]
    return {"private_modules_reexporting": len(private),
            "pure_private_shims": sum(r["pure_shim"] for r in private),
            "public_facades": sum(r["kind"] == "public" for r in rows),
            "package_inits": sum(r["kind"] == "package" for r in rows), "modules": rows}


# -- b. private imports -----------------------------------------------------------------------
def private_imports(modules: dict[str, Module]) -> dict[str, Any]:
    names, submodules = [], []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = module.resolve(node)
            if not source.startswith("snapkeep") or source == module.name:
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                row = f"{module.name}: from {source} import {alias.name}"
                (submodules if f"{source}.{alias.name}" in modules else names).append(row)
    # reaches into another object's private attribute
    own: set[str] = set()
    owners: dict[str, set[str]] = {}  # "module.Class" -> the _attrs its methods assign on self
    for module in modules.values():
        for cls, node in _in_classes(module.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                own.add(node.attr)
                if cls is not None:
                    owners.setdefault(f"{module.name}.{cls}", set()).add(node.attr)
    reaches, other_class = [], []
    for module in modules.values():
        for cls, node in _in_classes(module.tree):
            if isinstance(node, ast.Attribute) and node.attr in own and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                row = f"{module.name}:{node.lineno} .{node.attr}"
                reaches.append(row)
                if cls is None or node.attr not in owners.get(f"{module.name}.{cls}", set()):
                    other_class.append(row)  # not another instance of the reaching class
    def order(row: str) -> tuple[str, int, str]:
        where, attr = row.split(" ", 1)
        module, line = where.rsplit(":", 1)
        return module, int(line), attr

    reaches.sort(key=order)
    other_class.sort(key=order)
    saver = [r for r in reaches if r.endswith("._saver")
             and (r.startswith("snapkeep.training") or r.startswith("snapkeep._cli"))]
    return {"private_names": len(names), "private_submodules": len(submodules),
            "private_attribute_reaches": len(reaches),
            "private_attribute_reaches_other_class": len(other_class),
            "training_reaches_saver": len(saver),
            "names": names, "submodules": submodules, "saver_reaches": saver,
            "reaches": reaches, "reaches_other_class": other_class}


def _in_classes(tree: ast.AST) -> Iterator[tuple[str | None, ast.AST]]:
    """Every node of ``tree`` with the name of the innermost class around it (None: none)."""
    stack: list[tuple[str | None, ast.AST]] = [(None, tree)]
    while stack:
        cls, node = stack.pop()
        yield cls, node
        inner = node.name if isinstance(node, ast.ClassDef) else cls
        stack.extend((inner, child) for child in ast.iter_child_nodes(node))


# -- c. cycles --------------------------------------------------------------------------------
def import_graph(modules: dict[str, Module], *, package_edges: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for node in module_level_imports(module):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                source = module.resolve(node)
                # `from pkg import sub` needs pkg only as sub's parent (excluded); a name
                # that is not a submodule needs pkg's own code
                subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
                targets = subs + ([source] if package_edges or len(subs) < len(node.names)
                                  else [])
            for target in targets:
                if target in modules and target != module.name:
                    graph[module.name].add(target)
    return graph


def _cycles(graph_of: dict[str, set[str]]) -> dict[str, Any]:
    import networkx

    graph = networkx.DiGraph()
    for source, targets in graph_of.items():
        graph.add_node(source)
        graph.add_edges_from((source, t) for t in targets)
    components = [sorted(c) for c in networkx.strongly_connected_components(graph) if len(c) > 1]
    elementary = []
    for cycle in networkx.simple_cycles(graph):
        elementary.append(cycle)
        if len(elementary) >= 10000:
            break
    return {"components": len(components), "elementary_cycles": len(elementary),
            "elementary_capped_at_10000": len(elementary) >= 10000,
            "component_members": components,
            "shortest": [" -> ".join(c + [c[0]]) for c in sorted(elementary, key=len)[:10]]}


def cycles(modules: dict[str, Module]) -> dict[str, Any]:
    """Two graphs: *strict* has the edges Python runs (``from pkg import sub`` needs ``pkg``
    only as ``sub``'s parent, which a partly initialised package satisfies); *with package
    edges* also counts ``pkg`` there (what simpler tools draw)."""
    return {"excluded": "function-level imports, `if TYPE_CHECKING:` imports, implicit parent "
                        "packages",
            "strict": _cycles(import_graph(modules, package_edges=False)),
            "with_package_edges": _cycles(import_graph(modules, package_edges=True))}


# -- d. traced save and resume ----------------------------------------------------------------
class Tracer:
    """Snapkeep files with call events: in the trainer thread inside chosen code objects, and
    on any other thread while the window is open."""

    def __init__(self, src: pathlib.Path) -> None:
        self.prefix = str(src / "snapkeep")
        self.entries: set[Any] = set()
        self.main = threading.main_thread()
        self.depth = 0
        self.window = False
        self.inside: set[str] = set()
        self.everything: set[str] = set()
        self.others: set[str] = set()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        filename = frame.f_code.co_filename
        mine = filename.startswith(self.prefix)
        if threading.current_thread() is not self.main:
            if self.window and mine and event == "call":
                self.others.add(filename)
            return
        if self.window and mine and event == "call":
            self.everything.add(filename)
        if self.depth:
            self.depth += 1 if event == "call" else -1
            if event == "call" and mine:
                self.inside.add(filename)
        elif event == "call" and frame.f_code in self.entries:
            self.depth = 1
            if mine:
                self.inside.add(filename)

    def reset(self, entries: set[Any]) -> None:
        self.entries, self.depth = entries, 0
        self.inside, self.everything, self.others = set(), set(), set()


def _codes(obj: Any, method: str) -> set[Any]:
    out = set()
    for cls in type(obj).__mro__:
        fn = cls.__dict__.get(method)
        code = getattr(fn, "__code__", None)
        if code is not None:
            out.add(code)
    return out


def trace(src: pathlib.Path) -> dict[str, Any]:
    sys.path.insert(0, str(src))
    import torch

    from snapkeep.training import ExtensionsManager, extensions
    from snapkeep.writing import ThreadWriter

    def relative(files: set[str]) -> list[str]:
        return sorted(str(pathlib.Path(f).relative_to(src / "snapkeep")) for f in files)

    def run(out: str, iterations: int, measure: str) -> dict[str, list[str]]:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        writer = ThreadWriter(out_dir=out)
        manager = ExtensionsManager(model, optimizer, 100, iters_per_epoch=10, writer=writer)
        ext = extensions.snapshot(autoload=True)
        manager.extend(ext, trigger=(1, "iteration"))
        tracer = Tracer(src)
        found: dict[str, list[str]] = {}
        sys.setprofile(tracer)
        threading.setprofile(tracer)
        try:
            for i in range(iterations):
                entry = _codes(ext, "initialize" if measure == "resume" else "__call__")
                measured = (measure == "resume" and i == 0) or (measure == "save" and i == 1)
                tracer.reset(entry if measured else set())
                tracer.window = measured
                with manager.run_iteration():
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1.0)
                handle = getattr(writer, "last_handle", None)
                if handle is not None:
                    handle.committed.result(timeout=60)
                tracer.window = False
                if measured:
                    found = {"call": relative(tracer.inside | tracer.others),
                             "iteration": relative(tracer.everything | tracer.others)}
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            manager.finalize()  # the extension's lock and the writer
            writer.finalize()
        return found

    with tempfile.TemporaryDirectory(prefix="structure-report-") as out:
        save = run(out, 2, "save")
        resume = run(out, 1, "resume")
    return {"save_files": len(save["call"]), "save_iteration_files": len(save["iteration"]),
            "resume_files": len(resume["call"]),
            "resume_iteration_files": len(resume["iteration"]),
            "save": save["call"], "resume": resume["call"]}


def trace_checkpointer(src: pathlib.Path) -> dict[str, Any]:
    """Files the plain-loop door passes through: ``Checkpointer.save`` (its second save, with
    every snapkeep frame on other threads until it is committed) and ``Checkpointer.load`` in a
    fresh Checkpointer over the same directory."""
    sys.path.insert(0, str(src))
    import torch

    import snapkeep

    def relative(files: set[str]) -> list[str]:
        return sorted(str(pathlib.Path(f).relative_to(src / "snapkeep")) for f in files)

    model = torch.nn.Linear(4, 2)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    found: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="structure-report-") as out:
        for measure in ("save", "resume"):
            ckpt = snapkeep.Checkpointer(out)
            tracer = Tracer(src)
            sys.setprofile(tracer)
            threading.setprofile(tracer)
            try:
                if measure == "save":
                    ckpt.save(1, state).committed.result(timeout=60)
                    tracer.reset(_codes(ckpt, "save"))
                    tracer.window = True
                    ckpt.save(2, state).committed.result(timeout=60)
                else:
                    tracer.reset(_codes(ckpt, "load"))
                    tracer.window = True
                    ckpt.load(into=state)
                tracer.window = False
                found[measure] = relative(tracer.inside | tracer.others)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
                ckpt.close()
    return {"checkpointer_save_files": len(found["save"]),
            "checkpointer_resume_files": len(found["resume"]),
            "checkpointer_save": found["save"], "checkpointer_resume": found["resume"]}


# -- e. copies --------------------------------------------------------------------------------
def _functions(modules: dict[str, Module]) -> Iterator[tuple[str, ast.AST]]:
    for module in modules.values():
        stack: list[tuple[str, ast.AST]] = [(module.name, module.tree)]
        while stack:
            prefix, node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        yield name, child
                    stack.append((name, child))


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, nested functions and classes excluded."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _newest_first(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (_called(node) == "reversed" or (
        _called(node) == "sorted" and any(k.arg == "reverse" for k in node.keywords)))


REMOVERS = {"remove", "rm", "rm_file", "unlink"}


def copies(modules: dict[str, Module]) -> dict[str, Any]:
    found: dict[str, list[str]] = {"verify": [], "fallback": [], "delete": []}
    for name, function in _functions(modules):
        nodes = list(_own_nodes(function))
        calls = {_called(n) for n in nodes if isinstance(n, ast.Call)}
        words = {n.attr for n in nodes if isinstance(n, ast.Attribute)} \
            | {n.id for n in nodes if isinstance(n, ast.Name)} | calls
        digests = any("digest" in c or c == "hash_file" for c in calls)
        compares = "require_match" in calls or any(
            isinstance(n, ast.Compare) and any("checksum" in w for w in (
                {s.attr for s in ast.walk(n) if isinstance(s, ast.Attribute)}
                | {s.id for s in ast.walk(n) if isinstance(s, ast.Name)})) for n in nodes)
        if digests and compares:
            found["verify"].append(name)
        newest_first = {t.id for n in nodes if isinstance(n, ast.Assign) and _newest_first(n.value)
                        for t in n.targets if isinstance(t, ast.Name)}
        for loop in (n for n in nodes if isinstance(n, ast.For)):
            if _newest_first(loop.iter) or (isinstance(loop.iter, ast.Name)
                                            and loop.iter.id in newest_first):
                if any(isinstance(s, ast.Return) for b in loop.body for s in ast.walk(b)):
                    found["fallback"].append(name)
                    break
        removals = [n for n in nodes if isinstance(n, ast.Call) and _called(n) in REMOVERS]
        looped = any(isinstance(s, ast.Call) and _called(s) in REMOVERS
                     for loop in nodes if isinstance(loop, ast.For)
                     for b in loop.body for s in ast.walk(b))
        if removals and ("manifest_path" in words or any("marker" in w for w in words)) and (
                len(removals) >= 2 or looped or "remove_marker" in calls):
            found["delete"].append(name)
    return {k: len(v) for k, v in found.items()} | {"functions": found,
                                                    "method": "heuristic (see the docstring)"}


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(ROOT / "src"), help="the src/ holding snapkeep/")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-trace", action="store_true", help="skip d (needs torch)")
    args = parser.parse_args(argv)
    src = pathlib.Path(args.src).resolve()
    modules = load_modules(src)
    report: dict[str, Any] = {
        "modules": len(modules), "re_exports": re_exports(modules),
        "private_imports": private_imports(modules), "cycles": cycles(modules),
        "copies": copies(modules)}
    if not args.no_trace:
        report["trace"] = trace(src) | trace_checkpointer(src)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    r, p, c, k = (report["re_exports"], report["private_imports"], report["cycles"],
                  report["copies"])
    print(f"snapkeep modules: {report['modules']} ({src / 'snapkeep'})")
    print(f"a. private modules re-exporting names: {r['private_modules_reexporting']} "
          f"(pure shims: {r['pure_private_shims']}); public facades: {r['public_facades']}; "
          f"package __init__ files: {r['package_inits']}")
    for row in r["modules"]:
        print(f"     {row['kind']:<8} {row['module']}: {row['names']} name(s)"
              f"{' [pure shim]' if row['pure_shim'] else ''}, e.g. {', '.join(row['examples'])}")
    print(f"b. cross-module private imports: {p['private_names']} names, "
          f"{p['private_submodules']} private submodules; reaches into another object's "
          f"private attribute: {p['private_attribute_reaches']}, of which outside the class "
          f"that owns it: {p['private_attribute_reaches_other_class']} (training/CLI -> "
          f"._saver: {p['training_reaches_saver']})")
    for row in p["names"]:
        print(f"     {row}")
    for row in p["reaches_other_class"]:
        print(f"     reach: {row}")
    print(f"c. import cycles ({c['excluded']} excluded)")
    for variant in ("strict", "with_package_edges"):
        v = c[variant]
        print(f"   {variant}: {v['components']} strongly connected component(s), "
              f"{v['elementary_cycles']} elementary cycle(s)")
        for row in v["shortest"]:
            print(f"     {row}")
    if "trace" in report:
        t = report["trace"]
        print(f"d. files a save passes through: {t['save_files']} (whole iteration: "
              f"{t['save_iteration_files']}); a resume: {t['resume_files']} (whole first "
              f"iteration: {t['resume_iteration_files']})")
        print(f"     save:   {' '.join(t['save'])}")
        print(f"     resume: {' '.join(t['resume'])}")
        print(f"   Checkpointer: a save {t['checkpointer_save_files']} files, a resume "
              f"{t['checkpointer_resume_files']}")
        print(f"     save:   {' '.join(t['checkpointer_save'])}")
        print(f"     resume: {' '.join(t['checkpointer_resume'])}")
    print(f"e. copies ({k['method']}): verify {k['verify']}, newest-valid-with-fallback "
          f"{k['fallback']}, delete {k['delete']}")
    for what, names in k["functions"].items():
        print(f"     {what}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
