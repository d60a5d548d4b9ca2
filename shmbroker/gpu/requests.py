"""Items' request options in a GPU process: decoded from the words their records carry (once per
distinct set: a job's items usually share one) and checked against what the engine honours (its
registry entry's `honours`, engines/catalogue.py). An item whose options are not readable, or ask
for something its engine cannot honour, fails alone (`invalid`, naming the option) before its engine
sees it: it is never run other than as asked. So does one asking for more samples (`n`) than its
consumer's max_batch_size: a card must hold them all at once.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..request.options import OptionsColumn, OptionsError, RequestOptions, decode

DECODED_MAX = 4096  # distinct option sets a GPU process keeps decoded


class RequestReader:
    """Decodes option words (with a cache of the last DECODED_MAX sets) for one engine."""

    def __init__(self, engine_name: str, honours: frozenset[str], max_samples: int = 1 << 30):
        self.engine_name = engine_name
        self.honours = honours
        self.max_samples = max_samples  # the consumer's max_batch_size: a card runs n samples at once
        self._decoded: OrderedDict[bytes, RequestOptions | str] = OrderedDict()

    def resolve(self, words) -> tuple[OptionsColumn | None, dict[int, str]]:
        """(the items' options as an OptionsColumn, or None when none has options; {position: why}
        of the items that must fail `invalid`). `words`: `segments.OptionWords` or None."""
        if words is None:
            return None, {}
        decoded = [self._decode(w) for w in words.sets]
        bad = [k for k, d in enumerate(decoded) if isinstance(d, str)]
        errors: dict[int, str] = {}
        if bad:
            for row in np.flatnonzero(np.isin(words.index, bad)).tolist():
                errors[row] = decoded[int(words.index[row])]
        return OptionsColumn([None if isinstance(d, str) else d for d in decoded], words.index), errors

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
            if not refused and opts.samples > self.max_samples:
                got = (f"it asks for n = {opts.samples} samples; this consumer runs at most max_batch_size = "
                       f"{self.max_samples} sequences at once")
        self._decoded[key] = got
        if len(self._decoded) > DECODED_MAX:
            self._decoded.popitem(last=False)
        return got
