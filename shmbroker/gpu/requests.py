"""Items' request options in a GPU process: decoded from the words their records carry (once per
distinct set: a job's items usually share one) and checked against what the engine honours (its
registry entry's `honours`, engines/catalogue.py). An item whose options are not readable, or ask
for something its engine cannot honour, fails alone (`invalid`, naming the option) before its engine
sees it: it is never run other than as asked. So does one asking for more samples (`n`) than its
consumer's max_batch_size: a card must hold them all at once. So does an item of the other task
than its consumer's (request/options.py `Task`): an embedding on a consumer that generates, or the
other way round.

A constraint (request/structured.py) names its payload by digest: it is read from the payload store
(disk/payloads.py) once per distinct set and checked against its digest. A payload that is missing
or does not hash to its digest fails its items `corrupt`: they never run unconstrained.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from dataclasses import replace
from typing import NamedTuple

from ..disk.payloads import PayloadError
from ..request.options import OptionsColumn, OptionsError, RequestOptions, Task, decode
from ..request.structured import NO_DIGEST
from ..ring.items import Status

DECODED_MAX = 4096  # distinct option sets a GPU process keeps decoded


class Refusal(NamedTuple):
    """Why an item's options cannot run: the status it fails with and the words saying why."""

    status: Status
    why: str


class RequestReader:
    """Decodes option words (with a cache of the last DECODED_MAX sets) for one engine; `payloads`:
    the broker's payload store (disk/payloads.py), where constraints' payloads are read."""

    def __init__(self, engine_name: str, honours: frozenset[str], max_samples: int = 1 << 30, payloads=None,
                 task: Task = Task.GENERATE):
        self.engine_name = engine_name
        self.task = task
        self.honours = honours
        self.max_samples = max_samples  # the consumer's max_batch_size: a card runs n samples at once
        self.payloads = payloads
        self._decoded: OrderedDict[bytes, RequestOptions | Refusal] = OrderedDict()

    def resolve(self, words) -> tuple[OptionsColumn | None, dict[int, Refusal]]:
        """(the items' options as an OptionsColumn, or None when none has options; {position: Refusal}
        of the items that must fail). `words`: `segments.OptionWords` or None."""
        if words is None:
            return None, {}
        decoded = [self._decode(w) for w in words.sets]
        bad = [k for k, d in enumerate(decoded) if isinstance(d, Refusal)]
        errors: dict[int, Refusal] = {}
        if bad:
            for row in np.flatnonzero(np.isin(words.index, bad)).tolist():
                errors[row] = decoded[int(words.index[row])]
        return OptionsColumn([None if isinstance(d, Refusal) else d for d in decoded], words.index), errors

    def wrong_task(self, column: OptionsColumn | None, rows) -> dict[int, Refusal]:
        """{row: Refusal} of items `rows` without options whose consumer embeds (an item without
        options generates); an item with options is judged with them (`_checked`)."""
        if self.task is Task.GENERATE:
            return {}
        rows = np.asarray(rows, np.int64)
        if column is not None:
            rows = rows[column.index[rows] < 0]
        why = self._task_refusal(Task.GENERATE)
        return {int(r): why for r in rows.tolist()}

    def _task_refusal(self, asked: Task) -> Refusal:
        serves = "embeds (task = \"embed\")" if self.task is Task.EMBED else "generates (task = \"generate\")"
        wants = "a vector of its prompt" if asked is Task.EMBED else "generated tokens"
        return Refusal(Status.INVALID, f"it asks for {wants}, and this consumer's engine {self.engine_name!r} "
                                       f"{serves}: its model's requests of that kind go to a consumer that serves them")

    def _decode(self, words) -> RequestOptions | Refusal:
        """The options of these words (their constraint's payload read), or why the item must fail."""
        key = words.tobytes()
        got = self._decoded.get(key)
        if got is not None:
            self._decoded.move_to_end(key)
            return got
        got = self._checked(words)
        if isinstance(got, RequestOptions) and got.structured is not None:
            got = self._with_payload(got)
        self._decoded[key] = got
        if len(self._decoded) > DECODED_MAX:
            self._decoded.popitem(last=False)
        return got

    def _checked(self, words) -> RequestOptions | Refusal:
        try:
            opts = decode(words)
        except OptionsError as exc:
            return Refusal(Status.INVALID, f"its request options are not readable: {exc}")
        if opts.task is not self.task:
            return self._task_refusal(opts.task)
        refused = [name for name in opts.given() if name not in self.honours]
        if refused:
            return Refusal(Status.INVALID, f"engine {self.engine_name!r} does not honour the option(s) "
                                           f"{', '.join(map(repr, refused))}")
        if opts.samples > self.max_samples:
            return Refusal(Status.INVALID, f"it asks for n = {opts.samples} samples; this consumer runs at most "
                                           f"max_batch_size = {self.max_samples} sequences at once")
        return opts

    def _with_payload(self, opts: RequestOptions) -> RequestOptions | Refusal:
        s = opts.structured
        if s.digest == NO_DIGEST:
            return opts
        if self.payloads is None:
            return Refusal(Status.INVALID, "its constraint names a payload, and this process reads no payload store")
        try:
            return replace(opts, structured=s.with_payload(self.payloads.get(s.digest)))
        except (PayloadError, ValueError) as exc:
            return Refusal(Status.CORRUPT, f"its constraint's payload cannot be used: {exc}")
