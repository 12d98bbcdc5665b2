"""A generation held open at its last token, to look at its own KV cache (qspec/batch.py: every
generation is a sequence of its own, whose pages go back to the pool when it ends)."""

import contextlib


@contextlib.contextmanager
def running(eng, prompt, **kw):
    """Yields (tokens, kv, stats) of eng.tokens(prompt, **kw) after its last token, before it ends:
    kv is the generation's cache (length = prompt + tokens - 1). `stats` is filled on exit."""
    stats: dict = {}
    gen = eng.tokens(prompt, stats=stats, **kw)
    toks: list[int] = []
    for t in gen:
        toks.append(t)
        if len(toks) == kw.get("max_new_tokens", 128) or t in eng.eos_ids:
            break
    try:
        (seq,) = eng.batcher.live
        yield toks, seq.kv, stats
    finally:
        gen.close()
