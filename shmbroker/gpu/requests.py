"""Items' request options in a GPU process: decoded from the words their records carry (once per
distinct set: a job's items usually share one) and checked against what the engine honours (its
registry entry's `honours`, engines/catalogue.py). An item whose options are not readable, or ask
for something its engine cannot honour, fails alone (`invalid`, naming the option) before its engine
sees it: it is never run other than as asked.
"""

from __future__ import annotations

from collections import OrderedDict

from ..request.options import OptionsError, RequestOptions, decode

DECODED_MAX = 4096  # distinct option sets a GPU process keeps decoded


class RequestReader:
    """Decodes option words (with a cache of the last DECODED_MAX sets) for one engine."""

    def __init__(self, engine_name: str, honours: frozenset[str]):
        self.engine_name = engine_name
        self.honours = honours
        self._decoded: OrderedDict[bytes, RequestOptions | str] = OrderedDict()

    def resolve(self, words: list | None) -> tuple[list | None, dict[int, str]]:
        """(one RequestOptions or None per item, or None when none has options; {position: why} of
        the items that must fail `invalid`)."""
        if words is None:
            return None, {}
        options: list = [None] * len(words)
        errors: dict[int, str] = {}
        for k, w in enumerate(words):
            if w is None:
                continue
            got = self._decode(w)
            if isinstance(got, str):
                errors[k] = got
            else:
                options[k] = got
        return options, errors

    def _decode(self, words) -> RequestOptions | str:
        """The options of these words, or why the item must fail (a string)."""
        key = words.tobytes()
        got = self._decoded.get(key)
        if got is not None:
            self._decoded.move_to_end(key)
            return got
        try:
            opts = decode(words)
        except OptionsError as exc:
            got = f"its request options are not readable: {exc}"
        else:
            refused = [name for name in opts.given() if name not in self.honours]
            got = opts if not refused else (
                f"engine {self.engine_name!r} does not honour the option(s) {', '.join(map(repr, refused))}")
        self._decoded[key] = got
        if len(self._decoded) > DECODED_MAX:
            self._decoded.popitem(last=False)
        return got
