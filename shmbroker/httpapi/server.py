"""The HTTP process: the Starlette app on uvicorn, and the batches' runner beside it.

Starlette and uvicorn (with python-multipart for uploads) are a small, well-kept ASGI stack: an
upload streams through an async handler without holding a worker thread (a slow client costs a
coroutine and its bytes on disk), and downloads stream from the file. `http_main` is the `http`
role of `supervise` (its socket bound by the supervisor, so a taken address fails the start);
`serve` is `shmbroker serve-http` beside a running broker.

The event loop never waits on disk or on a lock: a handler that reads or syncs a file (a batch's
job, a record saved, a file deleted) runs in a worker thread, and an upload's own sync too. Only
the upload's bytes are written from the loop (to the page cache, in the chunks they come in).
"""

from __future__ import annotations

import inspect
import logging
import threading

from .app import (Api, cancel_batch, create_batch, create_file, delete_file, list_batches, list_files, list_models)
from .batches import BatchStore
from .files import FileStore
from .objects import ApiError, file_object
from .runner import Runner

log = logging.getLogger("shmbroker.http")
NEEDS = "the HTTP API needs starlette, uvicorn and python-multipart: pip install 'shmbroker[http]'"


def build_app(api: Api):
    """The ASGI app of `api`'s routes."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.exceptions import HTTPException
        from starlette.requests import ClientDisconnect
        from starlette.responses import FileResponse, JSONResponse, Response
        from starlette.routing import Route
    except ImportError:
        raise RuntimeError(NEEDS) from None

    def answer(fn):
        """The route of handler `fn`: an async one runs on the event loop (it awaits its disk work in a
        thread itself); a plain one in a worker thread, as it may read or sync files or wait on a lock."""
        async def endpoint(request):
            try:
                if inspect.iscoroutinefunction(fn):
                    got = await fn(api, request, **request.path_params)
                else:
                    got = await run_in_threadpool(fn, api, request, **request.path_params)
            except ApiError as exc:
                return JSONResponse(exc.body(), exc.status)
            except ClientDisconnect:
                return Response(status_code=400)  # nobody reads it; the upload left no file
            if isinstance(got, Response):
                return got
            return JSONResponse(got)
        return endpoint

    def retrieve_file(api, request, file_id):
        return file_object(api.files.get(api.tenant(request), file_id))

    def file_content(api, request, file_id):
        meta = api.files.get(api.tenant(request), file_id)
        return FileResponse(api.files.path(file_id), media_type="application/octet-stream",
                            filename=meta["filename"])

    def retrieve_batch(api, request, batch_id):
        return api.batch_view(api.batches.get(api.tenant(request), batch_id))

    async def http_error(request, exc):
        message = {404: f"Unknown request URL: {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, exc.detail)
        return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code)

    async def server_error(request, exc):
        log.exception("%s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, "The server had an error while processing your request.").body(), 500)

    routes = [Route("/v1/files", answer(create_file), methods=["POST"]),
              Route("/v1/files", answer(list_files), methods=["GET"]),
              Route("/v1/files/{file_id}", answer(retrieve_file), methods=["GET"]),
              Route("/v1/files/{file_id}", answer(delete_file), methods=["DELETE"]),
              Route("/v1/files/{file_id}/content", answer(file_content), methods=["GET"]),
              Route("/v1/batches", answer(create_batch), methods=["POST"]),
              Route("/v1/batches", answer(list_batches), methods=["GET"]),
              Route("/v1/batches/{batch_id}", answer(retrieve_batch), methods=["GET"]),
              Route("/v1/batches/{batch_id}/cancel", answer(cancel_batch), methods=["POST"]),
              Route("/v1/models", answer(list_models), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def open_api(http_cfg, data_dir: str, models: list) -> Api:
    files, batches = FileStore(data_dir), BatchStore(data_dir)
    return Api(http_cfg, data_dir, files, batches, Runner(data_dir, files, batches), list(models))


def run(api: Api, sock, stopping, beat=lambda: None) -> None:
    """Serve on the bound `sock` and run the batches until `stopping()` (or uvicorn's own SIGINT/SIGTERM)."""
    try:
        import uvicorn
    except ImportError:
        raise RuntimeError(NEEDS) from None
    server = uvicorn.Server(uvicorn.Config(build_app(api), log_level="warning", access_log=False, lifespan="off",
                                           timeout_keep_alive=30, timeout_graceful_shutdown=10))
    done = threading.Event()

    def runner():
        api.runner.run(lambda: stopping() or done.is_set(), beat)
        server.should_exit = True

    thread = threading.Thread(target=runner, name="batches", daemon=True)
    thread.start()
    try:
        server.run(sockets=[sock])
    finally:
        done.set()
        api.runner.bell.set()
        thread.join(30)


def http_main(cfg, sock, slot, stopping) -> None:
    """The `http` role: the API on the supervisor's bound socket."""
    from ..control.segment import beat

    run(open_api(cfg.http, cfg.data_dir, cfg.served_models()), sock, stopping, lambda: beat(slot))
