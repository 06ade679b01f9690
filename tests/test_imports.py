"""The direction of imports inside weft, checked on the source: every module under weft/ is parsed with `ast`
(nothing is imported), its imports are resolved (relative ones included, and those inside functions), and
each is checked against the layer rules below.

The layers: `language/` is device code (what runs inside `@triton.jit`, plus the backend flag it branches on);
`runtime/` is the host runtime; `kernels/` are the op families; `weft.ops` the ops (collected from the families'
declarations); `layers/` and `models/` reach kernels only through `weft.ops`; `testing/`, `bench/` and the commands may import anything.
KNOWN_VIOLATIONS lists the edges that break a rule today, each with its reason; it is exact: an entry that no
longer occurs fails too, so that it is deleted when its import is fixed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "weft"

# Module -> layer: the first rule whose prefix matches (a package's own __init__ included).
LAYER_OF = [
    ("weft.language", "language"), ("weft.runtime", "runtime"), ("weft.kernels", "kernels"),
    ("weft.layers", "layers"), ("weft.models", "models"), ("weft.testing", "testing"), ("weft.bench", "bench"),
    ("weft.ops", "ops"), ("weft.distributed", "distributed"), ("weft.tuning.suites", "bench"),
    ("weft.tuning", "tuning"),
    ("weft.cli", "commands"), ("weft.__main__", "commands"), ("weft.demo", "commands"),
]
ROOT = "weft"  # weft/__init__.py: the public host API (init, empty, ...), which imports weft.ops

# Layer -> (the layers it may import, the rule in words). Every layer may import itself.
EVERYTHING = {"language", "runtime", "tuning", "kernels", "ops", "distributed", "root", "layers", "models", "testing",
              "bench", "commands"}
RULES = {
    "language": (set(), "language/ is device code: it imports only language/ and what it branches on at trace "
                        "time (runtime.backend, runtime.settings, runtime.errors); host code belongs in runtime/"),
    "runtime": ({"language"}, "runtime/ is the host runtime: it imports nothing of testing/, kernels/, layers/, "
                              "models/, the ops, bench/ or the commands"),
    "tuning": ({"runtime"}, "tuning/ (the measured tables and their lookup) imports only runtime/; its sweeps "
                            "(tuning.suites) are benchmarks"),
    "kernels": ({"language", "runtime", "tuning"}, "kernels/ (op families) import only language/, runtime/, "
                                                   "tuning/ and each other"),
    "ops": ({"kernels", "runtime"}, "the ops import only kernels/ and runtime/"),
    "distributed": ({"runtime", "ops"}, "weft.distributed (the torch.distributed backend) imports only runtime/ and "
                                        "the ops"),
    "root": ({"runtime", "ops", "distributed"}, "weft/__init__ imports only runtime/, the ops and weft.distributed"),
    "layers": ({"root", "ops", "runtime"}, "layers/ reach kernels only through weft.ops (and import no models/, "
                                           "testing/ or bench/)"),
    "models": ({"root", "ops", "runtime", "layers", "tuning"}, "models/ reach kernels only through weft.ops and "
                                                               "layers/, read tuning/'s measured choices, and "
                                                               "import no testing/ or bench/"),
    "testing": (EVERYTHING, ""), "bench": (EVERYTHING, ""), "commands": (EVERYTHING, ""),
}
# What language/ may import of runtime/: what device code branches on at trace time (the backend flag, the settings
# such as WEFT_WAIT_TIMEOUT_S compiled into every wait) and the error a wait raises under the interpreter.
LANGUAGE_MAY_IMPORT = {"weft.runtime.backend", "weft.runtime.settings", "weft.runtime.errors"}
# Third-party packages a layer must not import: device code holds no torch tensors.
FORBIDDEN_PACKAGES = {"language": {"torch": "language/ is device code: torch (host tensors) belongs in runtime/"}}

# (importer, imported) -> why the edge is there today. Delete an entry when its import is fixed.
KNOWN_VIOLATIONS = {
}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_sources(package: Path = PACKAGE) -> dict[str, tuple[str, bool]]:
    """Every module under `package`: name -> (source, whether it is a package's __init__)."""
    return {module_name(p, package): (p.read_text(), p.name == "__init__.py") for p in sorted(package.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    if module == ROOT:
        return "root"
    for prefix, layer in LAYER_OF:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def imports_of(module: str, source: str, is_package: bool, modules) -> list[tuple[int, str, str]]:
    """(line, the import as written, the module it reaches) for every import in `source`, at any depth (lazy
    imports inside functions count). `from X import name` reaches X.name where that is a module, else X."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, f"import {alias.name}", alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 > len(package) - 1:
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top-level package")
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            written = f"from {'.' * node.level}{node.module or ''} import "
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                found.append((node.lineno, written + alias.name, target))
    return found


def violations(sources: dict[str, tuple[str, bool]]) -> tuple[dict, list[str]]:
    """The rule-breaking edges: (importer, imported) -> the first failure message naming it; and the messages
    of modules that belong to no layer."""
    found, unplaced = {}, []
    for module, (source, is_package) in sources.items():
        layer = layer_of(module)
        if layer is None:
            unplaced.append(f"{module}: in no layer of the import rules (add its package to LAYER_OF and RULES)")
            continue
        allowed, rule = RULES[layer]
        for line, written, target in imports_of(module, source, is_package, sources):
            top = target.split(".")[0]
            if top != "weft":
                why = FORBIDDEN_PACKAGES.get(layer, {}).get(top)
                if why:
                    found.setdefault((module, top), f"{module}:{line}: `{written}`: {why}")
                continue
            target_layer = layer_of(target)
            if target_layer == layer or target_layer in allowed:
                continue
            if layer == "language" and target in LANGUAGE_MAY_IMPORT:
                continue
            found.setdefault((module, target), f"{module}:{line}: `{written}` reaches {target} "
                                               f"({target_layer or 'no layer'}): {rule}")
    return found, unplaced


def check(sources, known) -> list[str]:
    """Every failure: an edge that breaks a rule and is not known, a known edge that no longer occurs, a module
    in no layer."""
    found, failures = violations(sources)
    failures += [message for edge, message in sorted(found.items()) if edge not in known]
    failures += [f"KNOWN_VIOLATIONS entry {edge} ({reason}) no longer occurs: delete it"
                 for edge, reason in sorted(known.items()) if edge not in found]
    return failures


def test_imports_follow_the_layers():
    sources = read_sources()
    # The walk found the tree (a wrong path would check nothing).
    assert {"weft", "weft.language.tile", "weft.runtime.world", "weft.kernels.common", "weft.ops"} <= set(sources)
    failures = check(sources, KNOWN_VIOLATIONS)
    assert not failures, "import rules broken:\n" + "\n".join(failures)


# -- the checker on synthetic trees ------------------------------------------------------------------

SYNTHETIC = {
    "weft": ("from .runtime import backend\nfrom . import ops\n", True),
    "weft.ops": ("from .kernels import fam\n", False),
    "weft.runtime": ("", True),
    "weft.runtime.backend": ("import os\n", False),
    "weft.runtime.streams": ("import torch\n", False),
    "weft.language": ("from .core import x\n", True),
    "weft.language.core": ("import triton\nfrom ..runtime.backend import INTERPRET\n", False),
    "weft.kernels": ("", True),
    "weft.kernels.fam": ("import weft.language as wl\nfrom ..runtime import streams\n", False),
    "weft.layers": ("", True),
    "weft.layers.mlp": ("import weft\nfrom weft import ops\n", False),
    "weft.testing": ("from ..kernels import fam\n", True),
}


def test_a_clean_synthetic_tree_passes():
    assert check(SYNTHETIC, {}) == []


@pytest.mark.parametrize("module, source, edge, words", [
    ("weft.language.tile", "from ..runtime import streams\n", ("weft.language.tile", "weft.runtime.streams"),
     "language/ is device code"),
    ("weft.language.tile", "import torch\n", ("weft.language.tile", "torch"), "torch (host tensors)"),
    ("weft.runtime.launcher", "def run():\n    from ..testing import ranks\n",
     ("weft.runtime.launcher", "weft.testing"), "runtime/ is the host runtime"),
    ("weft.layers.mlp", "from weft.kernels.fam import f\n", ("weft.layers.mlp", "weft.kernels.fam"),
     "through weft.ops"),
    ("weft.kernels.fam", "from ..layers import mlp\n", ("weft.kernels.fam", "weft.layers.mlp"), "each other"),
    ("weft.models", "import weft.testing\n", ("weft.models", "weft.testing"), "no testing/"),
])
def test_a_synthetic_violation_is_caught(module, source, edge, words):
    tree = dict(SYNTHETIC, **{module: (source, module == "weft.models")})
    found, _ = violations(tree)
    assert list(found) == [edge]
    assert module in found[edge] and words in found[edge]
    assert check(tree, {edge: "known"}) == []


def test_a_stale_known_violation_fails():
    failures = check(SYNTHETIC, {("weft.layers.mlp", "weft.kernels.fam"): "fixed since"})
    assert len(failures) == 1 and "no longer occurs" in failures[0]


def test_a_module_in_no_layer_fails():
    failures = check(dict(SYNTHETIC, **{"weft.extras.thing": ("", False)}), {})
    assert len(failures) == 1 and "weft.extras.thing" in failures[0] and "no layer" in failures[0]


def test_relative_imports_resolve():
    modules = set(SYNTHETIC) | {"weft.language.ptx"}
    source = "from . import ptx\nfrom .core import x\nfrom ..runtime.backend import B\nfrom .. import ops\n"
    got = imports_of("weft.language.tile", source, False, modules)
    assert [target for _, _, target in got] == ["weft.language.ptx", "weft.language.core", "weft.runtime.backend",
                                                "weft.ops"]
    # In a package's __init__, `.` is the package itself.
    got = imports_of("weft.language", "from .core import x\nfrom ..runtime import backend\n", True, modules)
    assert [target for _, _, target in got] == ["weft.language.core", "weft.runtime.backend"]
