"""Recipes: the YAML files a run is described by (shipped ones by name, a user's file, a run folder's config.yaml),
`base:` inheritance, and `load_config`, which reads one and applies overrides."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import yaml

from accel_train.config.overrides import apply_overrides, build, spelled
from accel_train.config.schema import Config, TrainConfig, check_values, expand_paths
from accel_train.config.trust import RecipeFile, keys_named, sort_named_code, take_trust_from_command, value_at
from accel_train.errors import UserError
from accel_train.import_paths import IMPORT_PATH_KEYS, is_import_path, locate

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
CONFIG_FILE = "config.yaml"  # in a run folder: the resolved config and how the run was launched, itself a recipe


def list_recipes() -> dict[str, str]:
    """Shipped recipe names with their one-line descriptions."""
    return {
        path.stem: (yaml.safe_load(path.read_text()) or {}).get("description", "")
        for path in sorted(RECIPES_DIR.glob("*.yaml"))
    }


def load_config(recipe: str | Config, overrides: list[str] = ()) -> Config:
    """Resolve RECIPE (a shipped name, a YAML path, or a Config to copy), apply `key=value` overrides, validate."""
    if isinstance(recipe, Config):
        config, read = copy.deepcopy(recipe), Recipe({}, {}, [])
    else:
        read = _read_recipe(recipe)
        config = build(Config, read.tree, prefix="")
        config.recipe = recipe
        config.ignored_trust = take_trust_from_command(config, read.origins)
    given = apply_overrides(config, overrides)
    expand_paths(config)
    check_values(config, given)
    _resolve_lr(config.train, lr_given="train.lr" in given)
    sort_named_code(config, read.origins, read.own_folders, given)
    return config


class Recipe:
    """A recipe file read with its bases: the merged tree, the file each code-naming or trust key came from, and the
    folders of the user's own files among them (where the modules they name are looked for)."""

    def __init__(self, tree: dict, origins: dict[str, RecipeFile], own_folders: list[Path]) -> None:
        self.tree, self.origins, self.own_folders = tree, origins, own_folders


def _resolve_lr(train: TrainConfig, lr_given: bool) -> None:
    """train.lr from train.lr_base and the global batch, as timm's --lr-base: a recipe's own train.lr (a run's
    config.yaml records the one computed) gives way, while train.lr given as an override contradicts lr_base."""
    if train.lr_base is None:
        return
    ratio = train.batch_size / train.lr_base_batch
    formula = ("train.lr_base x train.batch_size / train.lr_base_batch" if train.lr_scale == "linear" else
               "train.lr_base x sqrt(train.batch_size / train.lr_base_batch)")
    if lr_given:
        raise UserError(f"train.lr={spelled(train.lr)} and train.lr_base={spelled(train.lr_base)} both given: "
                        f"train.lr_base computes train.lr from the global batch ({formula}); give one of them "
                        "(train.lr_base=null to set train.lr directly)")
    train.lr = train.lr_base * (ratio if train.lr_scale == "linear" else math.sqrt(ratio))


def _read_recipe(recipe: str, seen: tuple[str, ...] = ()) -> Recipe:
    path = Path(recipe)
    if path.is_dir() and (path / CONFIG_FILE).is_file():  # a run folder: the config it ran with
        path = path / CONFIG_FILE
    elif path.is_dir():
        raise UserError(f"recipe {recipe} is a folder without {CONFIG_FILE}, so not a run; pass a YAML file, a "
                        f"run's output_dir or a shipped recipe name ({', '.join(list_recipes())})")
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise UserError(f"recipe {recipe}: no such file; pass an existing YAML file, a run's output_dir or a shipped "
                        f"recipe name ({', '.join(list_recipes())})")
    if path.suffix not in (".yaml", ".yml"):
        path = RECIPES_DIR / f"{recipe}.yaml"
        if not path.is_file():
            raise UserError(f"unknown recipe '{recipe}': not a YAML file; shipped recipes are "
                            f"{', '.join(list_recipes())}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path} is not valid YAML: {err}".replace("\n", " ")) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"recipe {path} cannot be read as text ({err})") from None
    if not isinstance(tree, dict):
        raise UserError(f"recipe {path} must be a mapping of config keys")
    record = tree.pop("run", None)  # what a run's config.yaml records of its launch: facts, not settings
    run = run_folder_of(str(path)) is not None
    if run:
        tree.pop("resume", None)  # how that run was started, not a setting of a new one: given again, or not at all
    code = record.get("code") if isinstance(record, dict) and run else None
    file = RecipeFile(path.resolve(), own=not run, module_folders={
        str(module): str(folder) for module, folder in code.items()} if isinstance(code, dict) else {})
    origins = dict.fromkeys(keys_named(tree), file)
    own_folders = [file.path.parent] if file.own else []
    base = tree.pop("base", None)
    if base is None:
        return Recipe(tree, origins, own_folders)
    if base in seen:
        raise UserError(f"recipe {path}: 'base: {base}' forms a cycle")
    below = _read_recipe(base, seen + (recipe,))
    return Recipe(_merge(below.tree, tree), {**below.origins, **origins}, own_folders + below.own_folders)


def run_folder_of(recipe: str) -> Path | None:
    """The run folder a recipe is (its config.yaml is the config the run trained with), or None."""
    path = Path(recipe)
    folder = path if path.is_dir() else path.parent if path.name == CONFIG_FILE else None
    return folder if folder is not None and (folder / CONFIG_FILE).is_file() else None


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def save_config(config: Config, path: Path, run_info: dict) -> None:
    """Write the fully resolved config plus how the run was launched (when, where, the command line, processes,
    precision, versions). A recipe in itself: `run:` is read back as a record, not applied."""
    tree = config.to_dict()
    tree["run"] = {"recipe": config.recipe, **run_info}
    code = {}  # where each module its import paths name was found: this run's own modules are found there again
    for key in IMPORT_PATH_KEYS:
        name = value_at(tree, key)
        if isinstance(name, str) and is_import_path(name):
            located = locate(name, [])
            if located.holder is not None:
                code[located.module] = str(located.holder)
    if code:
        tree["run"]["code"] = code
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
