"""Checks of one parsed TOML document's values, each failure a ConfigError naming the file and the key.

`settings.py` (the broker's configuration) and `engines/options.py` (the simulated engine's
settings) read their tables through it.
"""

from __future__ import annotations

import math

from ..errors import ConfigError


class Validator:
    """Reads keys of tables from the file `where`, raising ConfigError(\"<where>: <key>: <why>, got <value>\")."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, why: str, value) -> None:
        got = "" if value is None else f", got {value!r}"
        raise ConfigError(f"{self.where}: {key}: {why}{got}")

    def no_unknown(self, raw: dict, known: set, at: str) -> None:
        for key in raw:
            if key not in known:
                name = f"{at}.{key}" if at else key
                raise ConfigError(f"{self.where}: unknown key {name!r} (known: {', '.join(sorted(known))})")

    def _key(self, key: str, at: str) -> str:
        return f"{at}.{key}" if at else key

    def string(self, raw: dict, key: str, at: str = "") -> str:
        value = raw[key]
        if not isinstance(value, str) or not value:
            self.fail(self._key(key, at), "must be a non-empty string", value)
        return value

    def pattern(self, raw: dict, key: str, regex, what: str, at: str = "") -> str:
        value = self.string(raw, key, at)
        if not regex.fullmatch(value):
            self.fail(self._key(key, at), f"must be {what}", value)
        return value

    def choice(self, raw: dict, key: str, options, at: str = "") -> str:
        value = raw[key]
        if value not in options:
            self.fail(self._key(key, at), f"must be one of {', '.join(options)}", value)
        return value

    def integer(self, raw: dict, key: str, lo: int, hi: int, *, multiple_of: int = 1, at: str = "") -> int:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(self._key(key, at), "must be an integer", value)
        if not lo <= value <= hi:
            what = "a positive integer" if lo == 1 else f"an integer in {lo}..{hi}"
            self.fail(self._key(key, at), f"must be {what}", value)
        if value % multiple_of:
            self.fail(self._key(key, at), f"must be a multiple of {multiple_of}", value)
        return value

    def number(self, raw: dict, key: str, lo: float, hi: float, *, low_open: bool = False, at: str = "") -> float:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(self._key(key, at), "must be a number", value)
        if value < lo or value > hi or (low_open and value == lo):
            bound = f"> {lo}" if low_open else f">= {lo}"
            self.fail(self._key(key, at), f"must be {bound} and <= {hi}", value)
        return float(value)
