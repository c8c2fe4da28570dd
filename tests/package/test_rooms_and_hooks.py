"""Contracts of the package's shape: rooms in an order, where a lower room never imports a higher one; tests that
reach inside through the package's hooks, never by reassigning it."""

import ast
from pathlib import Path

import pytest

from accel_train import hooks
from support.locations import REPO, TESTS

PACKAGE = REPO / "accel_train"

# The rooms, lowest first: a module may import from its own room and the rooms before it, never from a later one.
# (A room is a top-level module or package of accel_train.)
ROOMS = [
    ("base", {"errors", "console", "versions", "import_paths", "registry", "hooks"}),
    ("config", {"config"}),
    ("state", {"state"}),
    ("distributed", {"distributed"}),
    ("storage", {"storage"}),
    ("data and workloads", {"data", "workloads"}),
    ("run folder", {"run"}),
    ("training", {"training"}),
    ("Python API", {"api"}),
    ("commands", {"tools", "sweep", "launch"}),
    ("command line", {"cli", "__main__"}),
]
ORDER = {name: (index, room) for index, (room, names) in enumerate(ROOMS) for name in names}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every accel_train module the source of `module` imports, at module level or inside a function (under
    TYPE_CHECKING too)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from accel_train import hooks`
    return {name for name in found if name.startswith("accel_train.")}


def room_of(module: str) -> str:
    """The top-level name under accel_train: `accel_train.run.layout` -> `run`."""
    return module.split(".")[1].removesuffix(".py")


def test_every_module_is_in_a_room_and_no_lower_room_imports_a_higher_one():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50
    unplaced = sorted({room_of(module_name(path)) for path in modules if path != PACKAGE / "__init__.py"}
                      - ORDER.keys())
    assert not unplaced, f"modules in no room: {unplaced}; add each to ROOMS in {Path(__file__).name}"
    upward = []
    for path in modules:
        if path == PACKAGE / "__init__.py":  # the package's own door: its names load lazily, by name
            continue
        here = room_of(module_name(path))
        for target in imported_modules(path.read_text(), module_name(path), path.name == "__init__.py"):
            there = room_of(target)
            if there in ORDER and ORDER[there][0] > ORDER[here][0]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} ({ORDER[here][1]}) imports {target} "
                              f"({ORDER[there][1]})")
    assert not upward, "a lower room imports a higher one:\n" + "\n".join(upward)


def test_the_room_check_reads_imports_inside_functions_relative_ones_and_names_from_a_package():
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from accel_train.run.layout import MODEL_FILE\n\ndef late():\n    from ..training import loop\n"
              "    from accel_train import hooks\n    import accel_train.api\n")
    found = imported_modules(source, "accel_train.config.schema")
    assert {"accel_train.run.layout", "accel_train.training.loop", "accel_train.hooks", "accel_train.api"} <= found
    assert {room_of(name) for name in found} == {"run", "training", "hooks", "api"}



def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through their imports (more than one module each)."""
    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for target in imports.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    reach = {module: reached(module) for module in imports}
    groups = {tuple(sorted(other for other in reach[module] if module in reach[other]))
              for module in imports if module in reach[module]}
    return sorted(list(group) for group in groups if len(group) > 1)


def test_no_modules_import_each_other_in_a_circle_not_even_from_inside_a_function():
    # a package's __init__.py is the module its importers name: data/__init__.py is accel_train.data
    paths = {module_name(path).removesuffix(".__init__"): path for path in PACKAGE.rglob("*.py")}
    imports = {module: imported_modules(path.read_text(), module, path.name == "__init__.py") & paths.keys()
               for module, path in paths.items()}
    found = circles(imports)
    assert not found, "modules that import each other (move what both need into a module of its own):\n" + \
        "\n".join(" <-> ".join(group) for group in found)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

# --- tests reach inside through hooks ---------------------------------------------------------------------------------

REACHING_IN = [TESTS / "launched_probe.py", *sorted((TESTS / "support").glob("*.py"))]


def reassignments(path: Path) -> list[str]:
    """Lines of `path` that assign, delete or setattr an attribute of anything imported from accel_train."""
    tree = ast.parse(path.read_text())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accel_train":
            ours.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            ours.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                        if alias.name.split(".")[0] == "accel_train")

    def root(node) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if any(isinstance(part, ast.Attribute) and root(part) in ours for part in ast.walk(target)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "setattr" \
                and node.args and root(node.args[0]) in ours:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


@pytest.mark.parametrize("path", REACHING_IN, ids=lambda path: path.name)
def test_the_launched_probe_and_its_recorders_and_faults_reassign_nothing_of_the_package(path):
    assert reassignments(path) == []


def test_the_reassignment_check_finds_a_patched_function_a_class_attribute_and_setattr(tmp_path):
    patched = tmp_path / "patched.py"
    patched.write_text("from accel_train.training import loop\nimport accel_train.data\nfrom accel_train.data import "
                       "InMemoryImages as Images\nloop.set_up = print\naccel_train.data.make_loader = None\n"
                       "setattr(Images, '__getitems__', len)\nImages.size += 1\n")
    assert [line.split(": ")[0] for line in reassignments(patched)] == ["patched.py:4", "patched.py:5", "patched.py:6",
                                                                       "patched.py:7"]


class Calls(hooks.Hooks):
    """Notes each point it is called at, and changes what a point returns by tagging it."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def __getattribute__(self, attribute):
        if attribute.startswith("_") or attribute in ("name", "seen") or not hasattr(hooks.Hooks, attribute):
            return object.__getattribute__(self, attribute)

        def point(*args):
            self.seen.append((attribute, self.name))
            if attribute in ("accelerator_options", "data_built"):
                return [*args[0], self.name]
            if attribute == "after_forward":
                return [*args[-1], self.name]
            return attribute != "process_ends"  # a stuck process kept by any hook stays
        return point


def test_every_hook_point_reaches_every_hook_added_in_order_and_each_return_goes_to_the_next():
    points = [name for name in vars(hooks.Hooks) if not name.startswith("_")]
    assert len(points) >= 10
    seen = []
    with hooks.added(Calls("a", seen), Calls("b", seen)):
        every = hooks.every()
        for point in points:
            arguments = {"accelerator_options": ([],), "data_built": ([], "train"),
                         "after_forward": ("train", 1, None, None, [])}.get(point)
            result = getattr(every, point)(*(arguments or (None,) * (getattr(hooks.Hooks, point).__code__.co_argcount
                                                                      - 1)))
            if point in ("accelerator_options", "data_built", "after_forward"):
                assert result == ["a", "b"], point
            if point == "process_ends":
                assert result is False
    assert seen == [(point, name) for point in points for name in "ab"]
    assert hooks.every().accelerator_options({"cpu": True}) == {"cpu": True}  # outside, nothing is called


def test_no_module_reads_accelerates_private_attributes():
    # Accelerate's underscore names (its lists of prepared objects, its state's internals) change without notice: a
    # release that renames one would break every save. The package goes through Accelerate's public API only.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    accelerator = Accelerator(cpu=True)
    private = {name for holder in (accelerator, accelerator.state, Accelerator, AcceleratorState, PartialState)
               for name in dir(holder) if name.startswith("_") and not name.startswith("__")}
    assert {"_models", "_optimizers", "_schedulers", "_custom_objects", "_dataloaders"} <= private
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
    assert not found, "Accelerate's private attributes read:\n" + "\n".join(found)


# --- where a run folder's bytes live is one object --------------------------------------------------------------------

PLACE = PACKAGE / "run" / "place.py"


def mirror_uses(source: str) -> list[int]:
    """The lines of `source` that reach the Mirror: its class imported or named, or a place's `.mirror` read."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == "Mirror" \
                or isinstance(node, ast.Name) and node.id == "Mirror" \
                or isinstance(node, ast.Attribute) and node.attr in ("Mirror", "mirror"):
            found.add(node.lineno)
    return sorted(found)


def test_only_the_place_reaches_the_mirror_so_nothing_else_branches_on_a_run_folder_in_a_store():
    # Whoever reads or writes a run asks its place (run/place.py); a caller holding the Mirror would branch on
    # "local or store" again, as Checkpoints did in 17 places.
    assert mirror_uses(PLACE.read_text()), f"{PLACE.name} no longer holds the Mirror: point this test at its module"
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py")) if path != PLACE
             for line in mirror_uses(path.read_text())]
    assert not found, "the Mirror reached outside run/place.py (ask the place instead):\n" + "\n".join(found)


def test_the_mirror_check_finds_an_import_a_name_and_a_places_mirror():
    source = ("from accel_train.run.place import Mirror\nimport accel_train.run.place\nmirror = Mirror('s3://b', 1)\n"
              "place.mirror.sync()\naccel_train.run.place.Mirror\nmirrored = place.shown(place.folder)\n")
    assert mirror_uses(source) == [1, 3, 4, 5]
