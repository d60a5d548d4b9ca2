"""Checks of one parsed TOML document's values, each failure a ConfigError naming the file and the key.

`Validator` reads keys of the file `where`. A key's check (`Integer`, `Number`, `Choice`, `Pattern`,
`Text`, `Flag`, `Address`) is declared once, in the `check` metadata of the field that holds the key
(`broker.py`) or in the table reader's check table (`engines.py`, `cluster.py`); it reads the key
through the validator and says in words what it takes (`describe`, for the reference).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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

    def key_name(self, key: str, at: str) -> str:
        return f"{at}.{key}" if at else key

    def string(self, raw: dict, key: str, at: str = "") -> str:
        value = raw[key]
        if not isinstance(value, str) or not value:
            self.fail(self.key_name(key, at), "must be a non-empty string", value)
        return value

    def pattern(self, raw: dict, key: str, regex, what: str, at: str = "") -> str:
        value = self.string(raw, key, at)
        if not regex.fullmatch(value):
            self.fail(self.key_name(key, at), f"must be {what}", value)
        return value

    def choice(self, raw: dict, key: str, options, at: str = "") -> str:
        value = raw[key]
        if value not in options:
            self.fail(self.key_name(key, at), f"must be one of {', '.join(options)}", value)
        return value

    def integer(self, raw: dict, key: str, lo: int, hi: int, *, multiple_of: int = 1, at: str = "") -> int:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(self.key_name(key, at), "must be an integer", value)
        if not lo <= value <= hi:
            what = "a positive integer" if lo == 1 else f"an integer in {lo}..{hi}"
            self.fail(self.key_name(key, at), f"must be {what}", value)
        if value % multiple_of:
            self.fail(self.key_name(key, at), f"must be a multiple of {multiple_of}", value)
        return value

    def number(self, raw: dict, key: str, lo: float, hi: float, *, low_open: bool = False, at: str = "") -> float:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(self.key_name(key, at), "must be a number", value)
        if value < lo or value > hi or (low_open and value == lo):
            bound = f"> {lo}" if low_open else f">= {lo}"
            self.fail(self.key_name(key, at), f"must be {bound} and <= {hi}", value)
        return float(value)


def bound_text(value) -> str:
    """A bound as the reference shows it: a power of two past 2^10 as `2^n`, a float short (`1e9`)."""
    if isinstance(value, int) and value >= 1 << 10 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return f"{value:g}".replace("e+0", "e").replace("e+", "e") if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Integer:
    """An integer in lo..hi (and a multiple of `multiple_of`)."""

    lo: int
    hi: int
    multiple_of: int = 1

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> int:
        return v.integer(raw, key, self.lo, self.hi, multiple_of=self.multiple_of, at=at)

    def describe(self) -> str:
        multiple = f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
        return f"{bound_text(self.lo)}..{bound_text(self.hi)}{multiple}"


@dataclass(frozen=True)
class Number:
    """A finite number in [lo, hi] (`low_open`: lo itself refused)."""

    lo: float
    hi: float
    low_open: bool = False

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> float:
        return v.number(raw, key, self.lo, self.hi, low_open=self.low_open, at=at)

    def describe(self) -> str:
        return f"{'>' if self.low_open else '>='} {bound_text(self.lo)} and <= {bound_text(self.hi)}"


@dataclass(frozen=True)
class Choice:
    """One of `options`."""

    options: tuple

    def read(self, v: Validator, raw: dict, key: str, at: str = ""):
        return v.choice(raw, key, self.options, at)

    def describe(self) -> str:
        return ", ".join(f"`{o}`" for o in self.options)


@dataclass(frozen=True)
class Pattern:
    """A non-empty string matching `regex` (`what` says which in words)."""

    regex: re.Pattern
    what: str

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> str:
        return v.pattern(raw, key, self.regex, self.what, at)

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class Text:
    """Any non-empty string."""

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> str:
        return v.string(raw, key, at)

    def describe(self) -> str:
        return "a non-empty string"


@dataclass(frozen=True)
class Flag:
    """true or false."""

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> bool:
        value = raw[key]
        if not isinstance(value, bool):
            v.fail(v.key_name(key, at), "must be true or false", value)
        return value

    def describe(self) -> str:
        return "`true` or `false`"


def parse_addr(text: str) -> tuple[str, int]:
    """"host:port" or "[v6-host]:port" -> (host, port); port 0 picks a free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError('must be "host:port" with a port in 0..65535 (or "" for no exporter)')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


@dataclass(frozen=True)
class Address:
    """"host:port" (`parse_addr`), or "" for none."""

    def read(self, v: Validator, raw: dict, key: str, at: str = "") -> str:
        value = raw[key]
        if not isinstance(value, str):
            v.fail(v.key_name(key, at), 'must be "host:port" (or "" for no exporter)', value)
        if value:
            try:
                parse_addr(value)
            except ValueError as exc:
                v.fail(v.key_name(key, at), str(exc), value)
        return value

    def describe(self) -> str:
        return '`"host:port"` or `"[v6-host]:port"` (port 0..65535), or `""`'


Check = Integer | Number | Choice | Pattern | Text | Flag | Address  # what a key's `check` metadata holds
