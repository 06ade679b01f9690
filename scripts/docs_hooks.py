"""mkdocs hooks of the documentation site (mkdocs.yml): the pages made from the tree at build time, never checked in.

- tutorials/<name>.md for every tutorials/*.py: the module docstring as prose, then the code, one block per
  top-level definition (a `@triton.jit` kernel is named as one), as Triton's own tutorials show theirs; then, for
  the `weft.ops` it calls, the `*_kernel`s of the declaring modules (collapsed).
- reference/ops.md: every op the families declare. `weft.ops` is filled in by the op registry
  (weft/kernels/registry.py) when it is imported, so static analysis sees no function in it; the page is made from
  the registry itself: each op's signature, docstring, operator(s) and declaring module, then the helper types.
- performance/index.md and performance/<family>.md from docs/performance/data/*.json (scripts/perf_pages.py).

The nav entries "Tutorials" and "Performance" of mkdocs.yml name a folder ("tutorials/", "performance/"); the
hook replaces each by the list of the pages made for it.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import os
import sys

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "tutorials")


def _perf_pages():
    spec = importlib.util.spec_from_file_location("perf_pages", os.path.join(ROOT, "scripts", "perf_pages.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- tutorials ----

def tutorial_files() -> list[str]:
    return sorted(f for f in os.listdir(TUTORIALS) if f.endswith(".py"))


def _docstring_title(doc: str) -> tuple[str, str]:
    """("Tutorial 02 — all-gather by ...", the rest) of a tutorial's module docstring."""
    first, _, rest = inspect.cleandoc(doc).partition("\n")
    return first.strip().rstrip("."), rest.strip("\n").rstrip()


def tutorial_nav_title(name: str) -> str:
    """"02 all-gather by pushing into peers' symmetric memory": the number, then the title up to its first colon."""
    with open(os.path.join(TUTORIALS, name)) as f:
        title, _ = _docstring_title(ast.get_docstring(ast.parse(f.read())) or name)
    topic = title.split("—", 1)[-1].split(":", 1)[0].strip()
    return f"{name.split('_', 1)[0]} {topic}"


def _is_triton_kernel(node: ast.AST) -> bool:
    for d in getattr(node, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def tutorial_page(name: str) -> str:
    """The page of tutorials/<name>: its docstring as prose, then its code, one block per top-level definition."""
    with open(os.path.join(TUTORIALS, name)) as f:
        source = f.read()
    tree = ast.parse(source)
    lines = source.splitlines()
    title, prose = _docstring_title(ast.get_docstring(tree) or name)
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    # Code sections start at each top-level def / class (its decorators and the comment lines right above it).
    starts, labels = [], []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            kind = "the kernel" if _is_triton_kernel(node) else ("a class" if isinstance(node, ast.ClassDef) else "")
            starts.append(start)
            labels.append(f"`{node.name}`" + (f" — {kind}" if kind else ""))
    first = body[0].lineno - 1 if body else len(lines)
    sections = [("Imports and setup", first, starts[0] if starts else len(lines))]
    sections += [(label, s, e) for label, s, e in zip(labels, starts, starts[1:] + [len(lines)])]
    library = library_kernels(tree)
    out = [f"# {title}", "", prose, "",
           f"The code below is `tutorials/{name}` as it is in this tree. Run it with `weft run -n 4 "
           f"tutorials/{name}` (cpu ranks without GPUs); the test suite runs it on 4 cpu ranks.", ""]
    for label, s, e in sections:
        code = "\n".join(lines[s:e]).strip("\n")
        if code:
            out += [f"## {label}", "", "```python", code, "```", ""]
    if library:
        out += ["## The library's kernels", "",
                "The `weft.ops` calls above run these kernels (their source in this tree; click to open):", ""]
        for path, ops, kernels in library:
            out += [f'??? example "`{path}`: {", ".join(f"`{n}`" for n, _ in kernels)} '
                    f'({", ".join(f"weft.ops.{o}" for o in ops)})"', ""]
            for _, code in kernels:
                out += ["    ```python"] + [("    " + line).rstrip() for line in code.splitlines()] + ["    ```", ""]
    return "\n".join(out)


def library_kernels(tree: ast.Module) -> list[tuple[str, list[str], list[tuple[str, str]]]]:
    """For the `weft.ops.X` a tutorial calls, in order of first use: (module path, its ops called, [(kernel name,
    source)]) of each declaring module's public `@triton.jit` kernels (`*_kernel`)."""
    registry = _registry()
    modules: dict[str, list[str]] = {}
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Attribute)), key=lambda n: (n.lineno, n.col_offset))
    for node in calls:
        name = ast.unparse(node)
        if name.startswith("weft.ops.") and name[len("weft.ops."):] in registry.OPS:
            op = name[len("weft.ops."):]
            module = sys.modules[registry.OPS[op].eager.__module__]
            ops = modules.setdefault(module.__file__, [])
            if op not in ops:
                ops.append(op)
    out = []
    for path, ops in modules.items():
        with open(path) as f:
            source = f.read()
        lines = source.splitlines()
        kernels = [(n.name, "\n".join(lines[min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1:n.end_lineno]))
                   for n in ast.parse(source).body
                   if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel") and _is_triton_kernel(n)]
        if kernels:
            out.append((os.path.relpath(path, ROOT), ops, kernels))
    return out


# ---- weft.ops reference ----

def _registry():
    """The op registry of this tree's weft, every family loaded."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import weft.ops  # noqa: F401  (loads every family: the registry is filled in)
    from weft.kernels import registry
    return registry


def ops_page() -> str:
    registry = _registry()
    out = ["# weft.ops", "",
           "Every public op of weft, generated from the op registry (`weft/kernels/registry.py`): each family "
           "declares its ops once, beside their implementation, and `weft.ops` collects them. `weft.ops.X` runs the "
           "implementation directly; a traced or differentiated call goes through the PyTorch operator "
           "`torch.ops.weft.X` (see [Plans and workspaces](../concepts/plans.md)). A collective op takes `group=` "
           "(default: the world) and every member of the group must call it.", "",
           "| op | declared in | collective |", "|---|---|---|"]
    for name, d in registry.OPS.items():
        out.append(f"| [`{name}`](#{name}) | `{d.eager.__module__}` | {'yes' if d.collective else 'no'} |")
    out.append("")
    for name, d in registry.OPS.items():
        operators = ", ".join(f"`torch.ops.weft.{getattr(o, 'weft_name', name)}`" for o in d.operators)
        out += [f"## {name}", "", "```py", f"weft.ops.{name}{inspect.signature(d.public)}", "```", "",
                f"Declared in `{d.eager.__module__}`" + (" · collective" if d.collective else "")
                + (f" · operators: {operators}" if operators else ""), "",
                inspect.cleandoc(d.public.__doc__ or "(no docstring)"), ""]
    if registry.EXPORTS:
        out += ["## Helper types", "", "Exported by `weft.ops` beside the ops; classes, not operators.", ""]
        for name, obj in registry.EXPORTS.items():
            out += [f"::: {obj.__module__}.{obj.__qualname__}", "    options:", "      heading_level: 3", ""]
    return "\n".join(out)


# ---- mkdocs events ----

class _KnownNoise(logging.Filter):
    """Drops two warnings that say nothing about the docs, so that `--strict` fails on every other one:
    griffe cannot evaluate `weft.ops.__all__` (built from the registry when imported: the ops page comes from the
    registry instead), and autorefs reads a docstring's prose such as `flags laid out [program][rank]` as a
    reference. Docstrings are prose, not written for cross-references; a page's unresolved reference still fails."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "Unsupported item in weft.ops.__all__" in msg:
            return False
        return not ("Could not find cross-reference target" in msg and f"from {os.path.join(ROOT, 'weft')}" in msg)


def on_config(config):
    for handler in logging.getLogger("mkdocs").handlers:
        handler.addFilter(_KnownNoise())
    perf = _perf_pages()
    generated = {
        "tutorials/": [{tutorial_nav_title(n): f"tutorials/{n[:-3]}.md"} for n in tutorial_files()],
        "performance/": [{"Overview": "performance/index.md"}]
        + [{title: f"performance/{family}.md"} for family, title in perf.families(perf.DATA_DIR)],
    }
    for entry in config.nav or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if isinstance(value, str) and value in generated:
                    entry[key] = generated[value]
    return config


def on_files(files, config):
    perf = _perf_pages()
    pages = {f"tutorials/{n[:-3]}.md": tutorial_page(n) for n in tutorial_files()}
    pages["reference/ops.md"] = ops_page()
    pages.update({f"performance/{name}": text for name, text in perf.render_all(perf.DATA_DIR).items()})
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files
