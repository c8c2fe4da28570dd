"""Whose word runs code: a recipe the user names (and their overrides, and what they build in Python) is theirs; a file
they did not hand this command as their own (a run folder's config.yaml, a copy of one from a store) is data, and the
code it names runs only on the command's word (`--trust-code`, `trust_code=True`) or where this user trained or
allowed exactly that code before.

What this user trained or allowed is recorded outside any run folder, in their own cache (direnv's `allow`, for
import paths): a digest of each import path the config names, the file its module is loaded from and the sha256 of
that module's code. Their own runs therefore need nothing; a folder that names other code, or a module file changed
since, needs the word again. Trust in a Hub repository's code and in pickled weights (model.trust_remote_code,
model.allow_pickled_weights) is never taken from a file at all: only from the command line or a Python call.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from accel_train.errors import UserError
from accel_train.import_paths import IMPORT_PATH_KEYS, Located, allow, distrust, is_distrusted, is_import_path, locate

TRUST_KEYS = ("model.trust_remote_code", "model.allow_pickled_weights")  # taken from the command, never from a file
TRUST_FLAG = "--trust-code"
RECORD_FILE = "trusted-code.json"


@dataclass(frozen=True)
class RecipeFile:
    """A YAML file a config was read from, and whether it is the user's own."""

    path: Path
    own: bool  # the user named it as their recipe (or it ships with accel-train): not a run folder's config.yaml
    module_folders: dict[str, str] = field(default_factory=dict)  # a run's config.yaml: module -> folder it loaded from

    def search_folders(self) -> list[Path]:
        """Where the modules this file names are looked for after sys.path (the current directory follows)."""
        if self.own:
            return [self.path.parent]
        return [Path(folder) for folder in self.module_folders.values()]


@dataclass(frozen=True)
class NamedCode:
    """An import path a config names through `key`, read from `origin` (a file this command does not trust)."""

    key: str
    path: str
    origin: RecipeFile

    def located(self) -> Located:
        return locate(self.path, [*self.origin.search_folders(), Path.cwd()])


def value_at(tree: dict, key: str):
    section, _, name = key.rpartition(".")
    node = tree.get(section) if section else tree
    return node.get(name) if isinstance(node, dict) else None


def keys_named(tree: dict) -> set[str]:
    """The keys that may name code or grant trust which this one file sets (before its base's are merged)."""
    return {key for key in (*IMPORT_PATH_KEYS, *TRUST_KEYS) if value_at(tree, key) is not None}


def take_trust_from_command(config, origins: dict[str, RecipeFile]) -> tuple[tuple[str, Path], ...]:
    """Trust keys a file set to true, set back to false: (key, file) of each, for one line saying so."""
    ignored = []
    for key in TRUST_KEYS:
        section, name = key.split(".")
        if getattr(getattr(config, section), name) and key in origins:
            setattr(getattr(config, section), name, False)
            ignored.append((key, origins[key].path))
    return tuple(ignored)


def sort_named_code(config, origins: dict[str, RecipeFile], own_folders: list[Path], given: set[str]) -> None:
    """Allow the import paths the user gave (their recipe, an override); mark those a file named that this command
    does not trust (config.untrusted_code), for `check_code` to allow or refuse."""
    untrusted = list(getattr(config, "untrusted_code", ()))
    for key in IMPORT_PATH_KEYS:
        path = value_at(config.to_dict(), key)
        if not isinstance(path, str) or not is_import_path(path):
            continue
        origin = origins.get(key) if key not in given else None
        if origin is None or origin.own:
            located = locate(path, [*own_folders, Path.cwd()])
            if located.found:  # else import_object says where it looked, when it is imported
                allow(path, located)
        else:
            distrust(path, refusal([NamedCode(key, path, origin)]))
            untrusted.append(NamedCode(key, path, origin))
    config.untrusted_code = tuple(untrusted)


def check_code(config, trust: bool) -> None:
    """Before anything is imported: the import paths in `config` that a file this command does not trust named are
    allowed, on the command's word (and remembered) or because this user trained or allowed that very code, or
    refused in one line naming each and how to trust them."""
    current = config.to_dict()
    pending = [code for code in getattr(config, "untrusted_code", ())
               if is_distrusted(code.path) and value_at(current, code.key) == code.path]
    if not pending:
        return
    located = [(code, code.located()) for code in pending]
    digest = code_digest([(code.key, code.path, where) for code, where in located])
    if not trust and not is_remembered(digest):
        raise UserError(refusal(pending, located=[where for _, where in located]))
    if trust:
        remember(digest, [(code.key, code.path, where) for code, where in located], "allowed with " + TRUST_FLAG)
    for code, where in located:
        allow(code.path, where)


def remember_trained(config) -> None:
    """A run this user starts from their own recipe: its code is theirs, so reading its run folder later needs no
    word (each process records it, so every machine of the job has the record)."""
    current = config.to_dict()
    named = [(key, value_at(current, key)) for key in IMPORT_PATH_KEYS]
    named = [(key, path, locate(path, [])) for key, path in named if isinstance(path, str) and is_import_path(path)]
    if named and not any(is_distrusted(path) for _, path, _ in named):
        remember(code_digest(named), named, "trained")


def refusal(pending: list[NamedCode], located: list[Located] | None = None) -> str:
    origin = pending[0].origin
    folder = origin.path.parent
    named = []
    for index, code in enumerate(pending):
        where = located[index] if located else None
        file = f" ({where.file})" if where is not None and where.file is not None else ""
        named.append(f"{code.key}={code.path}{file}")
    return (f"{origin.path} names code to import: {', '.join(named)}; code that a run folder names runs only on your "
            f"word, since anyone who could write {folder} could have put it there: if you trust it, add {TRUST_FLAG} "
            "(trust_code=True in Python), which this user's later reads of the same code then need no more")


def code_digest(named: list[tuple[str, str, Located]]) -> str:
    """What names the code: each key, import path, module file and the sha256 of the module's code."""
    items = sorted([key, path, str(where.file), where.content_hash()] for key, path, where in named)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def record_path() -> Path:
    """The user's own record of allowed code, beside accel-train's other caches (XDG_CACHE_HOME or ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accel-train" / RECORD_FILE


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: nothing is allowed by it
        return {}
    return record.get("allowed", {}) if isinstance(record, dict) else {}


def is_remembered(digest: str) -> bool:
    return digest in _read_record(record_path())


def remember(digest: str, named: list[tuple[str, str, Located]], why: str) -> None:
    """Add `digest` to the record, under a lock (the processes of a job write at once) and by an atomic rename.
    A record that cannot be written costs the user the word next time, never the run: not an error."""
    path = record_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            allowed = _read_record(path)
            if digest in allowed:
                return
            allowed[digest] = {"code": [f"{key}={code} ({where.file or 'built in'})" for key, code, where in named],
                               "why": why, "when": datetime.now().astimezone().isoformat(timespec="seconds")}
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({"allowed": allowed}, indent=1))
            os.replace(partial, path)
    except OSError:
        return
