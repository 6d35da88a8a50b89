"""Config keys that were renamed: a config file or command line that uses the old name still
runs, with one line on stderr naming the old key, the new one, and that the old name will go away.

`rename_overrides` rewrites `--config.OLD=value` on the command line before the config flag reads
it (the schema has no OLD, so ml_collections would refuse it); `resolve` moves a value a config
sets under the old name to the new one. Where both names are set: a command line that gives both
different values is refused in one line; a command line override wins over the file, under either
name, as overrides do; in a config file the old name's value wins (a config derived from one in
configs/ inherits the new key, then sets the old one) and the warning names the value it replaces.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Collection, MutableSequence

from digen_jax.app.errors import ConfigError

RENAMED: dict[str, str] = {"rl.micro_batch_size": "rl.grad_chunk_size"}  # old key -> new key


def warning(old: str, new: str, replaced: str = "") -> str:
    """The line naming the old key, the new one and that the old one will go away (`replaced`:
    what the old name's value overrode)."""
    return (f"warning: config key {old} is now {new} (same meaning){replaced}; {old} still works but will be "
            f"removed in a later version: set {new} instead")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def rename_overrides(argv: MutableSequence[str], flag: str = "config") -> list[tuple[str, str]]:
    """Rewrite `--FLAG.OLD=v` / `--FLAG.OLD v` in `argv` (in place) to the new key; the (old, new)
    keys so renamed (the caller warns). Raises ConfigError where the command line sets both names
    to different values."""
    renamed = []
    for old, new in RENAMED.items():
        values = {old: [], new: []}
        for i, arg in enumerate(argv):
            name, eq, value = arg.partition("=")
            key = name.lstrip("-").removeprefix(f"{flag}.")
            if name.startswith("-") and name.lstrip("-").startswith(f"{flag}.") and key in values:
                values[key].append((i, value if eq else (argv[i + 1] if i + 1 < len(argv) else "")))
        if not values[old]:
            continue
        given_old, given_new = values[old][-1][1], values[new][-1][1] if values[new] else None
        if given_new is not None and given_new != given_old:
            raise ConfigError(f"--{flag}.{old}={given_old} and --{flag}.{new}={given_new} both given: {old} is the "
                              f"old name of {new}; give only --{flag}.{new}")
        for i, _ in values[old]:
            dashes = argv[i][: len(argv[i]) - len(argv[i].lstrip("-"))]
            argv[i] = dashes + f"{flag}.{new}" + argv[i][len(dashes) + len(f"{flag}.{old}"):]
        renamed.append((old, new))
    return renamed


def _section(config, path: list[str]):
    node = config
    for part in path:
        if part not in node:
            return None
        node = node[part]
    return node


def resolve(config, *, command_line: Collection[str] = (), renamed_on_command_line: Collection[str] = (),
            warn: Callable[[str], None] = _stderr) -> None:
    """Move each old key `config` holds to its new name, in place, with a warning line.

    command_line: the keys a command line override set (under either name): their value stands.
    renamed_on_command_line: those `rename_overrides` renamed (warned about already)."""
    for old, new in RENAMED.items():
        *old_path, old_name = old.split(".")
        *new_path, new_name = new.split(".")
        section, target = _section(config, old_path), _section(config, new_path)
        if section is None or old_name not in section:
            continue
        value = section[old_name]
        current = target.get(new_name) if target is not None else None
        with getattr(section, "unlocked", contextlib.nullcontext)():
            del section[old_name]
        replaced = ""
        if new not in command_line:
            with getattr(target, "unlocked", contextlib.nullcontext)():
                target[new_name] = value
            if current is not None and current != value:
                replaced = f"; its value {value!r} replaces {new}={current!r}"
        if new not in renamed_on_command_line:
            warn(warning(old, new, replaced))
