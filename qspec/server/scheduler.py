"""Worker threads run the generations, first come first served; the event loop only queues jobs
and relays what they produce.

`parallel` workers each take the oldest waiting job and run it with Engine.tokens; the engine
batches the forwards of the generations running at once (continuous batching, qspec/batch.py),
and every greedy response is the one the request gets alone. Requests wait in a bounded FIFO
(`max_queue` waiting beyond the running ones; more are refused with a Retry-After estimate). A
worker hands each text delta to the request's asyncio queue with call_soon_threadsafe, checks
the job's cancel flag after every token (a client that went away, a stop string that matched)
and then closes the engine's token generator, which gives the sequence's KV pages back at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from ..errors import TensorParallelError
from ..tokenizer import TextStream

log = logging.getLogger("qspec.server")


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("the server is busy: too many requests are waiting")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One generation: prompt ids, limits, sampling, and where its results go."""

    id: str
    ids: list[int]
    max_new: int
    sampling: dict                  # temperature, top_p, seed (Engine.tokens keywords)
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None     # top alternatives per token when the reply carries logprobs
    echo: str | None = None         # the prompt's text, sent before the answer (completions' echo)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("delta", str) ... ("done" | "error", ...)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    def __init__(self, engine, draft_kwargs: dict, max_queue: int, metrics, parallel: int = 1):
        self.engine = engine
        self.draft_kwargs = draft_kwargs
        self.max_queue = max_queue
        self.parallel = parallel
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._job_seconds = 1.0  # EMA of a job's run time, for Retry-After
        self._running = 0
        self._jobs: set[Job] = set()  # running
        self._threads = [threading.Thread(target=self._run, name=f"qspec-generate-{i}", daemon=True)
                         for i in range(parallel)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise ShuttingDown()
            idle = self.parallel - self._running  # workers about to take a waiting job: not queued
            if len(self._waiting) - idle >= self.max_queue:
                wait = self._job_seconds * (len(self._waiting) + 1) / self.parallel
                raise QueueFull(max(1, min(60, math.ceil(wait))))
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()

    def stop(self, timeout: float) -> None:
        """Refuse new jobs, let the waiting and running ones finish (up to `timeout` seconds:
        then the rest are cancelled), and end the worker."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            with self._cv:
                for job in self._waiting:
                    job.cancel()
                for job in self._jobs:
                    job.cancel()
            for t in self._threads:
                t.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
                if job.cancelled.is_set():
                    job.emit("done", None)
                    continue
                self._running += 1
                self._jobs.add(job)
                self.metrics.running.set(self._running)
            t0 = time.perf_counter()
            try:
                done = self._generate(job)
                self._finished(job, done)
                job.emit("done", done)
            except TensorParallelError as e:  # a rank is gone: the engine cannot run again
                log.error("%s failed, stopping the server: %s", job.id, e)
                job.emit("error", e)
                os.kill(os.getpid(), signal.SIGTERM)  # the graceful shutdown; `qspec serve` then exits 1
            except Exception as e:  # a bug or an engine failure: the request fails, the server lives
                log.exception("request %s failed", job.id)
                job.emit("error", e)
            finally:
                with self._cv:
                    self._running -= 1
                    self._jobs.discard(job)
                    self.metrics.running.set(self._running)
                    self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.perf_counter() - t0)

    def _finished(self, job: Job, done: dict) -> None:
        """The request's metrics and its one log line (also when its client went away)."""
        self.metrics.generation(done)
        s = done["stats"]
        acc = f", acceptance {100 * s['acceptance_rate']:.0f}%" if s.get("drafted") else ""
        log.info("%s: prompt %d tok (%d cached), %d new tok, %.1f tok/s%s, %s", job.id, done["prompt_tokens"],
                 s.get("cached_prompt_tokens", 0), done["completion_tokens"], s.get("tokens_per_s", 0.0), acc,
                 done["finish_reason"])

    def _generate(self, job: Job) -> dict:
        stats: dict[str, float] = {}
        text = TextStream(self.engine.tokenizer, job.stops)
        eos = self.engine.eos_ids
        speculative = self.engine.draft is not None
        started = time.perf_counter()
        first_token_s = None
        n, finish, emitted = 0, "length", []
        if job.echo is not None:
            job.emit("delta", job.echo)
        if job.max_new == 0:  # echo alone: the prompt's logprobs, no completion
            done = {"finish_reason": finish, "prompt_tokens": len(job.ids), "completion_tokens": 0, "stats": stats,
                    "queue_s": started - job.queued_at, "first_token_s": 0.0}
            if job.logprobs is not None:
                done["logprobs"] = self._logprobs(job.ids, [], job.logprobs, echo=True)
            return done
        tokens = self.engine.tokens(job.ids, max_new_tokens=job.max_new, stats=stats, speculative=speculative,
                                    **job.sampling, **self.draft_kwargs)
        try:
            for tok in tokens:
                n += 1
                emitted.append(tok)
                if first_token_s is None:
                    first_token_s = time.perf_counter() - job.queued_at
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                delta = text.push(tok)
                if delta:
                    job.emit("delta", delta)
                if text.stopped or tok in eos:
                    finish = "stop"
                    break
        finally:
            tokens.close()  # fills the stats of what was emitted; the cache stays consistent
        rest = text.finish()
        if rest and finish != "cancelled":
            job.emit("delta", rest)
        done = {"finish_reason": finish, "prompt_tokens": len(job.ids), "completion_tokens": n,
                "stats": stats, "queue_s": started - job.queued_at, "first_token_s": first_token_s or 0.0}
        if job.logprobs is not None and finish != "cancelled":
            done["logprobs"] = self._logprobs(job.ids, emitted, job.logprobs, echo=job.echo is not None)
        return done

    def _logprobs(self, ids: list[int], emitted: list[int], top: int, echo: bool) -> list[dict]:
        """Engine.score of the emitted tokens (with `echo`, of the prompt's from its second token on,
        the first one having none), with each token's text (its own decode) for the reply; an
        end-of-sequence token, which the text leaves out, is left out here too."""
        tok, eos = self.engine.tokenizer, self.engine.eos_ids

        def piece(t: int) -> str:
            return tok.decode([t], skip_special_tokens=False)

        def entry(t: int, logprob, top) -> dict:  # chars: its length in the reply's text (special: 0)
            return {"token": piece(t), "chars": len(tok.decode([t])), "logprob": logprob, "top": top}

        scored = self.engine.score(ids[:1], ids[1:] + emitted, top) if echo else self.engine.score(ids, emitted, top)
        first = [entry(ids[0], None, None)] if echo else []
        return first + [entry(lp.token, lp.logprob, [(piece(t), v) for t, v in lp.top])
                        for i, lp in enumerate(scored) if lp.token not in eos or echo and i < len(ids) - 1]
