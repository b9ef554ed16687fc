"""The daemon's settings read from their three sources, in order: a TOML file < `STAGERD_*` environment <
command-line flags; what is wrong in them is one `ConfigError` naming each setting, and a key or variable
that is not a setting names the closest one. What a setting is and what it accepts is `config.py`'s."""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

from stagerd.config import ENV_PREFIX, Settings
from stagerd.errors import ConfigError


def load_settings(config_file: str | Path | None = None, **flags: Any) -> Settings:
    """Settings from `config_file` (TOML), then `STAGERD_*`, then `flags` (None values are ignored)."""
    if config_file is not None and not Path(config_file).is_file():
        raise ConfigError("config file not found", path=config_file)
    toml_file = Path(config_file) if config_file is not None else None

    class _Sourced(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings]
            if toml_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
            return tuple(sources)

    _warn_unknown_env()
    try:
        return _Sourced(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as e:
        problems = "; ".join(_problem(err) for err in e.errors())
        raise ConfigError(
            f"invalid settings: {problems}", path=config_file, hint=_env_hint(e.errors())
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"not a TOML file: {e}",
            path=config_file,
            hint='write the config file in TOML (`keep_last = 3`, `sinks = ["s3://bucket/run"]`)',
        ) from None
    except ValueError as e:  # a variable of a list or table setting that is not JSON
        m = _ENV_FIELD.search(str(e))
        if m is None:
            raise ConfigError(f"cannot read settings: {e}", path=config_file) from None
        name = f"{ENV_PREFIX}{m.group(1).upper()}"
        raise ConfigError(f"{name} is not JSON: {os.environ.get(name, '')!r}", hint=_JSON_HINT) from None


# pydantic-settings' words for a variable it could not decode as JSON
_ENV_FIELD = re.compile(r'error parsing value for field "(\w+)" from source "EnvSettingsSource"')
_JSON_HINT = (
    "a list or table setting is JSON in the environment: STAGERD_SINKS='[\"s3://bucket/run\"]', "
    'STAGERD_SINK_RETENTION=\'{"s3://bucket/run": "last=3"}\''
)


# the settings that are a list or a table: JSON (or, for sinks, comma-separated) in the environment
_JSON_SETTINGS = ("sinks", "sink_retention")


def _env_hint(errors: list[Any]) -> str | None:
    """Where a failing setting came from its variable, the hint for that variable: the JSON form of a list
    or table setting, else to correct or unset the variable (a flag or file would not show it). None where
    none did (the usual hint)."""
    from_env = []
    for err in errors:
        name = str(err["loc"][0]) if err["loc"] else ""
        var = f"{ENV_PREFIX}{name.upper()}"
        if name in _JSON_SETTINGS and var in os.environ:
            return _JSON_HINT
        if name and os.environ.get(var) == err.get("input"):  # its value, not a flag's that overrode it
            from_env.append(var)
    if not from_env:
        return None
    return (
        f"correct or unset {', '.join(from_env)} in the environment; the configuration reference in "
        "README.md says what each takes"
    )


# pydantic's prefixes of an error raised by a validator, which say nothing to a user
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _problem(err: Any) -> str:
    """One validation error; a TOML key that is not a setting names the closest setting, as a variable
    does. An error of several settings together (`adopt_select needs adopt`) names them itself."""
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
        close = difflib.get_close_matches(where, list(Settings.model_fields), n=1)
        return f"{where}: not a setting" + (f" (did you mean {close[0]}?)" if close else "")
    msg = str(err["msg"])
    for prefix in _PYDANTIC_PREFIXES:
        msg = msg.removeprefix(prefix)
    return f"{where}: {msg}" if where else msg


# STAGERD_* variables that are read elsewhere, not settings: the fault-injection and test hooks, a fleet
# node's id, the switch of the C cast kernel
_NOT_SETTINGS = (
    "STAGERD_TEST_",
    "STAGERD_CRASH_",
    "STAGERD_DELAY_",
    "STAGERD_NODE_ID",
    "STAGERD_NO_HALFCAST",
)


def _warn_unknown_env() -> None:
    """A TOML key that is not a setting is refused; a variable is only warned about (the environment is
    shared with other tools), but never ignored in silence: STAGERD_SINK=... would publish nowhere."""
    known = [f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields]
    for name in sorted(os.environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(_NOT_SETTINGS):
            continue
        close = difflib.get_close_matches(name, known, n=1)
        logging.getLogger("stagerd").warning(
            "%s is not a stagerd setting and is ignored%s",
            name,
            f" (did you mean {close[0]}?)" if close else "",
        )
