"""The dependency direction documented in docs/architecture.md ("Layers") holds for every
import of ``loggra_megatron`` (function-level ones included), and no module imports itself
back through others."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loggra_megatron"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def documented_layers() -> dict[str, int]:
    """``{package or top-level module: layer}`` from the table under "## Layers"."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for row in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M):
        for name in re.findall(r"`(\w+)`", row[1]):
            layers[name] = int(row[0])
    assert layers, "docs/architecture.md has no layer table under '## Layers'"
    return layers


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path) -> set[str]:
    """The ``loggra_megatron`` modules (or names in them) a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "loggra_megatron"}


def unit(module: str) -> str | None:
    """The layered unit of a module: its first name below ``loggra_megatron``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_documented_layer():
    layers = documented_layers()
    units = {unit(m) for m in modules()} - {None}
    assert not units - set(layers), (
        f"{sorted(units - set(layers))}: place them in the layer table of docs/architecture.md"
    )
    assert not set(layers) - units, f"{sorted(set(layers) - units)} are documented but absent"


def test_imports_point_down_the_documented_layers():
    layers, known = documented_layers(), modules()
    wrong = []
    for module, path in known.items():
        here = unit(module)
        for name in imports(path):
            there = unit(name)
            if here not in layers or there not in layers or there == here:
                continue  # unplaced packages: test_every_package_has_a_documented_layer
            if layers[there] >= layers[here]:
                wrong.append(
                    f"{path.relative_to(ROOT)} (layer {layers[here]}) imports {name} "
                    f"(layer {layers[there]})"
                )
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(set(wrong)))


def test_no_module_imports_itself_back():
    known = modules()
    edges = defaultdict(set)
    for module, path in known.items():
        edges[module] = {name for name in imports(path) if name in known and name != module}
    cycles, done = [], set()

    def visit(module, trail):
        if module in trail:
            cycles.append(" -> ".join([*trail[trail.index(module) :], module]))
            return
        if module in done:
            return
        for other in sorted(edges[module]):
            visit(other, [*trail, module])
        done.add(module)

    for module in sorted(known):
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_the_adapter_layer_of_optim_imports_megatron_core():
    """The optimizers' math (``optim/`` outside ``optim/megatron/``: both sketches' wings, the
    settings, the registry) imports torch at most; Megatron-Core's internals are read in
    ``optim/megatron/`` only (docs/architecture.md, "Module map")."""
    wrong = []
    for module, path in modules().items():
        if not module.startswith("loggra_megatron.optim") or ".optim.megatron" in module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("megatron")]
    assert not wrong, "Megatron-Core imported outside optim/megatron/:\n" + "\n".join(wrong)
