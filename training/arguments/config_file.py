"""``--config FILE``: flag values from a YAML or TOML file, checked like the command line's.

Keys are flag names with dashes or underscores (``num-layers``, ``num_layers``), or the attribute a
flag sets (``add_bias_linear: false`` is ``--disable-bias-linear``); one level of sections is
flattened, so ``[model]`` tables may group them. A bad key or value raises one ``ValueError`` that
names the file, the key and what it expects.
"""

from __future__ import annotations

import difflib
from typing import Any

from training.arguments.schema import BY_DEST, BY_OPTION, Flag, coverage_of, rejected_values

REJECTED_DEST = "rejected:"
"""``load_config`` maps a key naming a flag Trident rejects to ``REJECTED_DEST + "--flag"``."""


def _convert(flag: Flag, key: str, option: str | None, value: Any, where: str) -> Any:
    """A config-file value as ``args`` would hold it after the same flag on the command line."""
    kind = "a bool" if flag.kind is bool else flag.kind.__name__
    bad = ValueError(
        f"{where}: key '{key}' ({flag.name}) expects {kind}{' list' if flag.nargs else ''}, got {value!r}"
    )
    if flag.kind is bool:
        if not isinstance(value, bool):
            raise bad
        return value if option is None else (value if flag.stores(option) else not value)
    if flag.nargs:
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, (str, int, float)) for v in items):
            raise bad
        try:
            return [flag.kind(v) for v in items]
        except (TypeError, ValueError):
            raise bad from None
    if isinstance(value, bool) or (flag.kind is int and isinstance(value, float)):
        raise bad
    try:
        value = flag.kind(value)
    except (TypeError, ValueError):
        raise bad from None
    if flag.choices and value not in flag.choices + rejected_values(flag.name):
        raise ValueError(f"{where}: key '{key}' must be one of {list(flag.choices)}, got {value!r}")
    return value


def _read_mapping(path: str, where: str) -> dict:
    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror})") from None
    if path.endswith(".toml"):
        import tomllib  # Python >= 3.11

        try:
            raw = tomllib.loads(text.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{where}: cannot parse it as TOML: {err}") from None
    else:
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{where}: cannot parse it as YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(  # noqa: TRY004 -- a bad file is a bad value, like every other config error
            f"{where}: expected a mapping of flag names to values, got {type(raw).__name__}"
        )
    return raw


def load_config(path: str) -> dict[str, Any]:
    """Flag values (by dest) from a YAML or TOML file; one level of tables/sections is flattened.

    A key naming a flag Trident rejects maps ``"rejected:--flag"`` to its value, for ``parse_args``.
    """
    where = f"config file {path}"
    items: list[tuple[str, Any]] = []
    for key, value in _read_mapping(path, where).items():
        if isinstance(value, dict):  # a [section] grouping flags
            items += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            items.append((str(key), value))
    values: dict[str, Any] = {}
    for shown, value in items:
        name = shown.rsplit(".", 1)[-1].strip().lstrip("-").replace("_", "-")
        option = "--" + name
        flag = BY_OPTION.get(option)
        dest_flag = BY_DEST.get(name.replace("-", "_"))
        if flag is None and dest_flag is None and coverage_of(option).rejected:
            values[REJECTED_DEST + option] = value
            continue
        if (flag or dest_flag) is None or (flag or dest_flag).dest == "config":
            close = difflib.get_close_matches(option, BY_OPTION, n=1)
            hint = f" (did you mean '{close[0][2:]}'?)" if close else ""
            raise ValueError(
                f"{where}: unknown key '{shown}'{hint}; keys are flag names such as "
                f"'tensor-model-parallel-size' or 'tensor_model_parallel_size'"
            )
        if value is not None:
            target = flag or dest_flag
            values[target.dest] = _convert(target, shown, option if flag else None, value, where)
    return values
