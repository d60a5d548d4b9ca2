"""The nats client on its own thread: one asyncio event loop, one connection, called from sync code.

The broker's loops stay synchronous; a `NatsLoop` runs the client's coroutines on its loop and
hands their results back with a deadline (`call`). nats-py is imported here, lazily
(`require_nats`), so the core install works without the `cluster` extra.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from ..errors import ConfigError
from .options import NatsOptions

MAX_RECENT_ERRORS = 3
_log = logging.getLogger(__name__)


def require_nats():
    """The nats-py module, or a ConfigError naming the extra that installs it."""
    try:
        import nats
        import nats.js  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"the cluster needs nats-py ({exc}): pip install 'shmbroker[cluster]'") from None
    return nats


async def connect(nats, o: NatsOptions, **callbacks):
    """A nats connection by the options (on the running loop); ConnectionError naming the servers."""
    kwargs = dict(servers=list(o.servers), name=o.name, connect_timeout=o.connect_timeout_seconds,
                  reconnect_time_wait=o.reconnect_wait_seconds, max_reconnect_attempts=o.max_reconnect_attempts,
                  allow_reconnect=True, tls=o.tls_context(), **callbacks)
    if o.user is not None:
        kwargs.update(user=o.user, password=o.password)
    if o.token is not None:
        kwargs["token"] = o.token
    if o.inbox_prefix is not None:
        kwargs["inbox_prefix"] = o.inbox_prefix
    if o.nkeys_seed_file is not None:
        try:
            import nkeys  # noqa: F401  (nats-py signs with it; not a dependency of nats-py itself)
        except ImportError:
            raise ConfigError("nkeys credentials need the nkeys package: pip install 'nats-py[nkeys]'") from None
        kwargs["nkeys_seed"] = o.nkeys_seed_file
    try:
        return await nats.connect(**kwargs)
    except Exception as exc:
        raise ConnectionError(f"cannot connect to NATS at {', '.join(o.servers)}: {type(exc).__name__}: {exc}") from None


class NatsLoop:
    """A daemon thread owning one event loop and one nats connection (`nc`, `js`), reconnecting
    on its own (bounded by `max_reconnect_attempts`). Coroutines that use `nc`/`js` run on the
    loop through `call`. `close()` drains the connection and stops the thread (idempotent)."""

    def __init__(self, options: NatsOptions, *, timeout_seconds: float | None = None):
        self.nats = require_nats()
        self.options = options
        self.nc = None
        self.js = None
        self.num_errors = 0
        self.num_disconnects = 0
        self.num_reconnects = 0
        self.last_error: BaseException | None = None
        self.recent_errors: list[str] = []  # distinct messages, the last MAX_RECENT_ERRORS
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="shmbroker-nats", daemon=True)
        self._thread.start()
        wait = timeout_seconds or options.connect_timeout_seconds + 1.0
        try:
            self.call(self._connect, timeout_seconds=wait)
        except TimeoutError:
            # nats-py retries a refused initial connect (bad credentials) without end: the deadline ends it
            self.close()
            why = f": {'; '.join(self.recent_errors)}" if self.recent_errors else ""
            raise ConnectionError(f"no connection to NATS at {', '.join(options.servers)} within {wait:g} s{why}") from None
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _connect(self) -> None:
        self.nc = await connect(self.nats, self.options, error_cb=self._on_error, disconnected_cb=self._on_disconnect,
                                reconnected_cb=self._on_reconnect)
        self.js = self.nc.jetstream()

    async def _on_error(self, exc: BaseException) -> None:
        self.num_errors += 1
        self.last_error = exc
        text = f"{type(exc).__name__}: {exc}"
        if text not in self.recent_errors:
            self.recent_errors = (self.recent_errors + [text])[-MAX_RECENT_ERRORS:]
        _log.debug("nats: %s: %s", type(exc).__name__, exc)

    async def _on_disconnect(self) -> None:
        self.num_disconnects += 1

    async def _on_reconnect(self) -> None:
        self.num_reconnects += 1

    def call(self, coro_fn, *args, timeout_seconds: float):
        """Run `coro_fn(*args)` on the loop and return its result; TimeoutError past the deadline
        (the coroutine is cancelled). Not from the loop's own thread."""
        if self._closed:
            raise ConnectionError("the nats connection is closed")
        assert threading.current_thread() is not self._thread
        future = asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop)
        try:
            return future.result(max(0.0, timeout_seconds))
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{getattr(coro_fn, '__name__', 'nats call')} took longer than {timeout_seconds:.3g} s") from None

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Drain the connection (what was published is flushed) and stop the thread. Idempotent."""
        if self._closed:
            return
        if self.nc is not None and not self.nc.is_closed:
            try:
                self.call(self._drain, timeout_seconds, timeout_seconds=timeout_seconds + 2.0)
            except Exception as exc:  # a dead server: nothing left to flush
                _log.debug("nats drain: %s", exc)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_seconds)
        if not self._thread.is_alive():
            self._loop.close()

    async def _drain(self, timeout_seconds: float) -> None:
        try:
            await asyncio.wait_for(self.nc.drain(), timeout_seconds)
        except Exception as exc:
            _log.debug("nats drain: %s", exc)
        if not self.nc.is_closed:
            await self.nc.close()
        # the client's own tasks (flusher, reader, pings) end here, not on a stopped loop
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NatsLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
