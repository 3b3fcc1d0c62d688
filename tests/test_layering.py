"""The package order of docs/architecture.md, checked over the source: every first-party import
goes to the same package or one listed before it, sits at the top of its module (not inside a
function, where it would hide a cycle), and names the defining module (not the `actloop` facade).
The exceptions are the optional extras listed in OPTIONAL, each with its reason. Inside `train/`
the folders have an order of their own (TRAIN_ORDER), checked the same way."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "actloop"
ORDER = ["types", "algos", "config", "sandbox", "models", "rewards", "envs", "data", "tasks", "rollout", "gateway",
         "monitor", "train", "tools", "cli"]
# train/'s folders, in import order; its top-level modules (trainer.py: the entry point) come last
TRAIN_ORDER = ["numerics", "runtime", "offline", "rl"]
# (module, imported module): function-level imports of optional extras, loaded only when chosen
OPTIONAL = {
    ("actloop/rollout/factory.py", "actloop.rollout.ray_engine"): "rollout.engine=ray needs the ray extra",
    ("actloop/train/numerics/optim.py", "actloop.train.numerics.optim8bit"): "train.optimizer=adamw_8bit: bitsandbytes costs 2 s to import",
}


def package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def first_party(path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "actloop"]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the module's package
            base = list(path.relative_to(ROOT.parent).with_suffix("").parts)[: -node.level]
            return [".".join(base + ([node.module] if node.module else []))]
        if node.module and node.module.split(".")[0] == "actloop":
            return [node.module]
    return []


def module_level(body: list[ast.stmt]):
    """ids of the statements run at import (inside module-level if / try / with too)."""
    for node in body:
        yield id(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for name in ("body", "orelse", "finalbody"):
                yield from module_level(getattr(node, name, []))
            for h in getattr(node, "handlers", []):
                yield from module_level(h.body)


def violations() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "__init__.py" or path == ROOT / "__main__.py":
            continue
        pkg = package(path)
        assert pkg in ORDER, f"{path}: package `{pkg}` is not in the layer order (add it to ORDER and the docs)"
        tree = ast.parse(path.read_text())
        top = set(module_level(tree.body))
        where = str(path.relative_to(ROOT.parent))
        for node in ast.walk(tree):
            for mod in first_party(path, node):
                parts = mod.split(".")
                if len(parts) == 1:
                    out.append(f"{where}:{node.lineno}: imports the `actloop` facade; import the defining module")
                    continue
                target = parts[1]
                if target not in ORDER and target != "__init__":
                    continue
                if ORDER.index(target) > ORDER.index(pkg):
                    out.append(f"{where}:{node.lineno}: {pkg} imports {mod} (a later layer)")
                if id(node) not in top and (where, mod) not in OPTIONAL:
                    out.append(f"{where}:{node.lineno}: function-level import of {mod}")
    return out


def test_packages_import_only_earlier_layers_at_module_top():
    assert violations() == []


def train_layer(parts: list[str]) -> int:
    """The layer of a module or folder under actloop/train/ (its path after `train`): its folder's
    place in TRAIN_ORDER, or after all of them for a top-level module."""
    return TRAIN_ORDER.index(parts[0]) if parts[0] in TRAIN_ORDER else len(TRAIN_ORDER)


def test_train_folders_import_only_earlier_folders():
    out = []
    train = ROOT / "train"
    for path in sorted(train.rglob("*.py")):
        rel = list(path.relative_to(train).with_suffix("").parts)
        if rel == ["__init__"]:
            continue
        assert len(rel) == 1 or rel[0] in TRAIN_ORDER, f"{path}: folder `{rel[0]}` is not in TRAIN_ORDER"
        for node in ast.walk(ast.parse(path.read_text())):
            for mod in first_party(path, node):
                parts = mod.split(".")
                if parts[:2] != ["actloop", "train"] or len(parts) < 3:
                    continue
                target = parts[2:]
                if target[0] in TRAIN_ORDER or (train / f"{target[0]}.py").exists():
                    if train_layer(target) > train_layer(rel):
                        out.append(f"{path.relative_to(ROOT.parent)}: train/{'/'.join(rel)} imports {mod} (a later folder)")
    assert out == []


def test_the_order_is_the_documented_one():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    assert " -> ".join(ORDER) in doc
