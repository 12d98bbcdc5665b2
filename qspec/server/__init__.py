"""`qspec serve`: an OpenAI-compatible HTTP server over one loaded Engine (README, "Server").

app.py holds the routes, schemas.py the request bodies, scheduler.py the queue and the worker
thread that runs generation, metrics.py the Prometheus metrics. Imported only by `qspec serve`
(fastapi and uvicorn are not imported by the rest of qspec)."""

from __future__ import annotations

import logging
import signal

from .app import Settings, create_app

__all__ = ["Settings", "create_app", "serve"]


def serve(engine, settings: Settings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM: then the listening socket closes, requests in flight finish
    (cut after settings.shutdown_timeout seconds) and the worker thread ends. Also stops when a
    tensor-parallel rank is lost, and then raises its TensorParallelError."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s qspec serve: %(message)s"))
    log = logging.getLogger("qspec.server")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.info("%s on http://%s:%d (context %d tokens, queue %d%s)", settings.model_id, host, port, settings.ctx,
             settings.max_queue, ", API key required" if settings.api_key else "")
    log.info("%s", engine.memory(settings.ctx))
    config = uvicorn.Config(create_app(engine, settings), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=settings.shutdown_timeout)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again with the handler it
    # found: a no-op here, so that a graceful stop exits 0 (SIGINT still ends as "interrupted")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    broken = getattr(getattr(engine.backend, "comm", None), "broken", None)
    if broken is not None:
        raise broken
