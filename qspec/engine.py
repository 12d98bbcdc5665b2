"""Engine: a loaded model + tokenizer + backend, and the public generate/stream API."""

from __future__ import annotations

import inspect
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence, Union

import numpy as np

from .config import ModelConfig
from .draft import DraftSpec
from .batch import Batcher, SeqBackend
from .errors import ContextMemoryError, ContextSizeError, PromptTooLongError
from .kv_cache import KVCache, Preempted
from .sampling import SamplingParams, argmax, sample, warp
from .levels import NGRAM, Chain, MXLevel, NgramLevel, is_helper
from .lookup import LOOKUP_MODES, Lookup
from .speculative import DRAFT_MAX_LIMIT, CostModel, DraftParams
from .result import GenerationResult, TokenLogprob, check_stops, check_top_logprobs, token_logprobs
from .tree import TreeCost, TreeParams
from .tokenizer import TemplateError, TextStream, Tokenizer

# Chosen by measurement on the dev prompts (README, "Choosing the draft"): MXFP4 with an MXFP4 LM
# head on real model sizes (Qwen2.5-Coder 0.5B and 1.5B); below SMALL_MODEL_PARAMS GEMM weights
# (SmolLM2-135M) MXFP4 agrees too rarely with BF16 and MXFP6-E2M3 is faster end to end.
DEFAULT_DRAFT = DraftSpec(fmt="mxfp4", lm_head="mxfp4")
SMALL_MODEL_DRAFT = DraftSpec(fmt="mxfp6_e2m3", lm_head="mxfp6_e2m3")
SMALL_MODEL_PARAMS = 300_000_000
DEFAULT_DRAFT_PARAMS = DraftParams(draft_max="auto", draft_min=1, draft_p_min=0.0)
# With sampling, "auto" picks K from run-time timings, and the tokens drawn depend on K: a fixed
# default K keeps seeded sampling reproducible (greedy output does not depend on K at all).
DEFAULT_SAMPLING_DRAFT_MAX = 1

# text, token ids, or a chat: [{"role": "system" | "user" | "assistant", "content": "..."}, ...]
Prompt = Union[str, list[int], list[dict[str, str]]]


# Draft trees by the ISA level the kernels run at and the model's size (README "Choosing the
# draft", chain / tree / a second level per ISA class): at the amx level, where a 16-row verify
# costs ~1.1 one-row passes, tree "auto" (the chain is one of its arms) was ahead of the chain on
# Qwen2.5-Coder-1.5B in 6 of 7 runs on two Xeons (1.0-1.17x) and level on the 0.5B; on AVX2 and
# AVX512-BF16 the chain was ahead, and below SMALL_MODEL_PARAMS (SmolLM2-135M: 1.24x against the
# chain's 1.47x) a tree's per-node Python work outweighs its ~7 ms steps: trees stay opt-in there.
DEFAULT_TREE = "off"
DEFAULT_TREE_BY_ISA = {"amx": "auto"}

MAX_SEQS = 16  # concurrent generations batched together (Engine.batcher)
SCORE_ROWS = 64  # logits rows a scoring pass returns at once: [64, vocab] float32 (39 MB at 152k)


def default_tree(kernel_path: str | None, gemm_params: int) -> str:
    """The tree mode `tree=None` takes for a model of `gemm_params` GEMM weights on a backend whose
    kernels run at ISA level `kernel_path` (None: a backend without native kernels)."""
    if gemm_params < SMALL_MODEL_PARAMS:
        return DEFAULT_TREE
    return DEFAULT_TREE_BY_ISA.get(kernel_path, DEFAULT_TREE)


class Backend(Protocol):
    """What the decoding loops need from a forward implementation (torch or native).

    A backend with a draft weight set also has `draft` (its DraftSpec), `draft_bytes`,
    `target_bytes`, `set_bytes` (per weight set), and accepts `draft=` in forward: True or 1 for
    the draft, 2.. for the MX draft levels above it."""

    cfg: ModelConfig
    kv: KVCache

    def forward(self, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False) -> np.ndarray:
        """Run tokens at positions start_pos.. (writing their K/V rows); logits [M or 1, V] float32,
        an array of the caller's own (the backend does not reuse it)."""
        ...


class Engine:
    """A loaded model. Create with `qspec.load()`."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, tokenizer: Tokenizer, backend: Backend,
                 eos_ids: set[int], levels: list | None = None, ctx_size: int | None = None,
                 max_seqs: int = MAX_SEQS):
        """`levels`: the drafting levels 1, 2, ... (qspec/levels.py); default: the backend's draft.
        `ctx_size`: prompt + new tokens per generation (default: the model's context).
        `max_seqs`: generations run together at most (more wait for a slot)."""
        self.model_dir = model_dir
        self.cfg = cfg
        self.ctx_size = cfg.max_seq_len if ctx_size is None else check_ctx_size(ctx_size, cfg)
        self.tokenizer = tokenizer
        self.backend = backend
        self.eos_ids = eos_ids
        if levels is None:
            levels = [MXLevel(backend, 1, backend.draft.fmt)] if getattr(backend, "draft", None) else []
        self.levels = levels
        self._cost_models: dict[tuple, CostModel] = {}
        # concurrent generations batch their forwards (qspec/batch.py); a helper level keeps one
        # cache of its own and tensor parallelism mirrors one sequence: those run one at a time
        serial = any(is_helper(lv.name) for lv in levels) or getattr(backend, "comm", None) is not None
        self.batcher = Batcher(backend, max_seqs=1 if serial else max_seqs)
        self._tree_costs: dict[tuple, TreeCost] = {}
        self._lookups: dict[tuple, Lookup] = {}

    # ---------------------------------------------------------------- public API
    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool | None = None,
                 speculative: bool = True, draft_max: int | str | Sequence | None = None,
                 draft_min: int | None = None, draft_p_min: float | None = None,
                 levels: int | None = None, tree: str | None = None, tree_width: int | None = None,
                 tree_depth: int | None = None, tree_nodes: int | None = None,
                 lookup: str | None = None, stop: str | Sequence[str] | None = None,
                 logprobs: int | None = None) -> GenerationResult:
        """Generate a continuation of `prompt`: text, token ids used as they are, or a chat as a
        list of {"role": ..., "content": ...} messages (rendered with the model's chat template).

        Greedy when temperature == 0. `chat=None` applies the chat template to a text prompt when
        the model has one. Stops at an EOS token, after `max_new_tokens`, or when the text holds
        one of the `stop` strings (a string or a list of up to 16): the text ends before it, and
        `tokens` end with the token that completed it (`finish_reason` "stop"; "length" when
        max_new_tokens ended it). `logprobs` = k in 0..20: `logprobs` of the result holds the
        target's log-probability of every new token and its k most likely alternatives (`score`).
        With a draft loaded and `speculative=True`, tokens are drafted with the MX weights and
        verified by the BF16 weights: the output is exactly what plain decoding gives (greedy:
        token for token; sampling: the same distribution). `draft_max` is K or "auto" for the
        draft (level 1), or a list with one entry per draft level (`qspec.load(draft_levels=...)`;
        levels not listed, and None entries, take the defaults). None takes the defaults in
        `qspec.DEFAULT_DRAFT_PARAMS` (with sampling: DEFAULT_SAMPLING_DRAFT_MAX for every level).
        `levels`: use only the first n draft levels of the engine's chain (default: all of them).
        A prompt that starts with token ids the cache still holds from earlier calls (the same
        prompt, or a chat's earlier turns and answers) is prefilled from where they end only;
        the output is the same bit for bit (`stats["cached_prompt_tokens"]` counts them).
        `tree`: draft trees (EAGLE-2 style, qspec/tree.py) from the MX draft at level 1: "auto"
        (tree or chain, whichever the cost model measures faster), "on", or "off" (the chain);
        None: default_tree ("auto" at the amx level from SMALL_MODEL_PARAMS up, else "off").
        `tree_width` (nodes expanded per depth and children per node, 1..8), `tree_depth` (draft
        passes, 1..32) and `tree_nodes` (N, verify rows with the root, 2..64, at least
        tree_depth + 1) cap the tree; unset ones are chosen.
        `lookup` (greedy): "auto" (the default) lets the target verify prompt-lookup candidates
        beside the MX draft's tokens, as many as the measured verify cost says pay
        (qspec/lookup.py); "off" verifies the draft's tokens alone.
        """
        stats: dict[str, float] = {}
        stops = check_stops(stop)
        if logprobs is not None:
            check_top_logprobs(logprobs)
        stream = TextStream(self.tokenizer, stops) if stops else None  # watches for a stop string
        tokens = []
        gen = self.tokens(prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, speculative, draft_max,
                          draft_min, draft_p_min, levels, stats=stats, tree=tree, tree_width=tree_width,
                          tree_depth=tree_depth, tree_nodes=tree_nodes, lookup=lookup)
        try:
            for t in gen:
                tokens.append(t)
                if stream is not None:
                    stream.push(t)
                    if stream.stopped:
                        break
        finally:
            gen.close()  # fills stats; the cache keeps what was emitted
        text = self.tokenizer.decode(tokens)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
        done = cut is not None or bool(tokens) and tokens[-1] in self.eos_ids
        scored = None if logprobs is None else self.score(self.encode_prompt(prompt, chat), tokens, logprobs)
        return GenerationResult(text=text if cut is None else text[:cut], tokens=tokens, stats=stats,
                                finish_reason="stop" if done else "length", logprobs=scored)

    def score(self, prompt: Prompt, continuation: Sequence[int], top_logprobs: int = 0,
              chat: bool | None = None) -> list[TokenLogprob]:
        """The target's log-probability of each token of `continuation` (token ids) after `prompt`
        (as `generate` takes it), with its `top_logprobs` (0..20) most likely alternatives: the
        log-softmax of the logits a plain BF16 decode computes at that position, bit for bit
        (one prefill-style pass over the tokens; batch invariance makes its rows the decode
        rows), whatever draft produced the tokens. Raw logits: no temperature or top-k/p."""
        check_top_logprobs(top_logprobs)
        ids = self.encode_prompt(prompt, chat)
        cont = self.encode_prompt(list(continuation), chat=False) if len(continuation) else []
        if len(ids) + len(cont) > self.ctx_size:
            raise PromptTooLongError(f"prompt ({len(ids)} tokens) + continuation ({len(cont)}) exceeds the "
                                     f"context of {self.ctx_size} tokens")
        seqids = ids + cont
        while True:
            seq = self.batcher.open(len(seqids))
            be = SeqBackend(self.batcher, seq)
            try:
                kv, out = be.kv, []
                pos = kv.adopt(ids, getattr(self.backend, "kernel_path", None))
                while pos < len(ids) - 1:  # the prompt's rows; its last one gives the first logits
                    end = min(len(ids) - 1, pos + self.batcher.prefill_chunk(seq))
                    be.forward(seqids[pos:end], pos, prefill=True)
                    kv.length = pos = end
                while pos < len(seqids) - 1:  # row r's logits score token r + 1
                    end = min(len(seqids) - 1, pos + SCORE_ROWS)
                    rows = be.forward(seqids[pos:end], pos, all_logits=True, prefill=True)
                    out += token_logprobs(rows, seqids[pos + 1:end + 1], top_logprobs)
                    kv.length = pos = end
                return out
            except Preempted:
                if not self.batcher.others(seq):
                    raise ContextMemoryError(f"{len(seqids)} tokens do not fit in the KV cache's budget") from None
            finally:
                self.batcher.close(seq)

    def batching(self, max_seqs: int, kv_tokens: int | None = None) -> None:
        """Run up to `max_seqs` generations together (an engine with a helper level or tensor
        parallelism keeps 1); `kv_tokens`: the KV pool's budget in positions (at least the context
        size; None: grow while memory allows). Past the budget the newest sequence is preempted."""
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an integer >= 1, got {max_seqs!r}")
        if self.batcher.max_seqs > 1:
            self.batcher.max_seqs = max_seqs
        if kv_tokens is not None:
            pool = self.batcher.pool
            if kv_tokens < self.ctx_size:
                raise ValueError(f"kv_tokens ({kv_tokens}) must hold the context size ({self.ctx_size})")
            pool.max_pages = max(pool.pages, -(-kv_tokens // pool.page_size))

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 128,
                       **kwargs) -> list[GenerationResult]:
        """`generate` for every prompt, run together: their forwards share each step's passes
        (continuous batching, qspec/batch.py; at most `max_seqs` at once, the rest join as
        others finish). Results in the order of `prompts`; a greedy result is exactly what
        `generate` gives for that prompt alone. The first error raised by any prompt is raised."""
        from concurrent.futures import ThreadPoolExecutor

        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("generate_batch needs a list of prompts")
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(len(prompts), self.batcher.max_seqs),
                                thread_name_prefix="qspec-seq") as ex:
            futures = [ex.submit(self.generate, p, max_new_tokens, **kwargs) for p in prompts]
            return [f.result() for f in futures]

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool | None = None,
               speculative: bool = True, draft_max: int | str | Sequence | None = None,
               draft_min: int | None = None, draft_p_min: float | None = None, levels: int | None = None,
               stats: dict[str, float] | None = None, stop: str | Sequence[str] | None = None,
               **tree_caps) -> Iterator[str]:
        """Like `generate`, yielding text pieces as tokens are produced; fills `stats` at the end.
        A tail that could begin a `stop` string is held back until the next tokens decide it."""
        stream = TextStream(self.tokenizer, check_stops(stop))
        gen = self.tokens(prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, speculative,
                          draft_max, draft_min, draft_p_min, levels, stats=stats, **tree_caps)
        try:
            for t in gen:
                piece = stream.push(t)
                if piece:
                    yield piece
                if stream.stopped:
                    break
        finally:
            gen.close()
        tail = stream.finish()
        if tail:
            yield tail

    def tokens(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool | None = None,
               speculative: bool = True, draft_max: int | str | Sequence | None = None,
               draft_min: int | None = None, draft_p_min: float | None = None, levels: int | None = None,
               stats: dict[str, float] | None = None, tree: str | None = None, tree_width: int | None = None,
               tree_depth: int | None = None, tree_nodes: int | None = None,
               lookup: str | None = None) -> Iterator[int]:
        """Like `generate`, yielding the new token ids as they are produced; fills `stats` at the end.

        Closing the generator early (a caller that stops iterating) leaves the engine ready for
        the next call: the cache's committed length is set by every prefill."""
        st = stats if stats is not None else {}
        if tree is None:
            tree = default_tree(getattr(self.backend, "kernel_path", None), self.cfg.gemm_params)
        tp = TreeParams(tree, tree_width, tree_depth, tree_nodes)
        if lookup is None:
            lookup = "auto"
        if lookup not in LOOKUP_MODES:
            raise ValueError(f"lookup must be one of {', '.join(LOOKUP_MODES)}, got {lookup!r}")
        return self._tokens(prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, st,
                            speculative, draft_max, draft_min, draft_p_min, levels, tp, lookup)

    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """The token ids a prompt is run as (see `generate` for the three kinds of prompt)."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.encode_messages(prompt)
        elif isinstance(prompt, str):
            use_chat = self.tokenizer.chat_template is not None if chat is None else chat
            if use_chat and self.tokenizer.chat_template is None:
                raise ValueError("chat=True but this model has no chat template")
            ids = self.tokenizer.encode_chat(prompt) if use_chat else self.tokenizer.encode(prompt)
        else:
            if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, (Sequence, np.ndarray)) or not all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise TypeError("a prompt is text, a list of token ids or a list of {'role', 'content'} "
                                f"messages, got {type(prompt).__name__}")
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat (role/content messages) rendered with the model's chat template, ready for the
        assistant's answer. With the usual templates, the ids of a chat that adds the answer and
        a new user message start with the ids of the chat before it followed by the answer's
        tokens, so the next turn reuses the cache rows of the previous one."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; send a text prompt")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        try:
            return self.tokenizer.encode_messages(messages)
        except TemplateError as e:  # the template's own raise_exception, e.g. roles out of order
            raise ValueError(f"the chat template refused these messages: {e}") from None

    # ---------------------------------------------------------------- decoding
    @property
    def draft(self) -> "DraftSpec | None":
        """The loaded draft (format, LM head format), or None."""
        return getattr(self.backend, "draft", None)

    @property
    def chain(self) -> list[str]:
        """The names of the drafting levels, level 1 first (e.g. ["mxfp6_e2m3", "mxfp4", "ngram"])."""
        return [lv.name for lv in self.levels]

    def _tokens(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, stats: dict[str, float],
                speculative, draft_max, draft_min, draft_p_min, levels, tp: TreeParams,
                lookup: str) -> Iterator[int]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed)
        if levels is None:
            levels = len(self.levels)
        elif isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= max(1, len(self.levels)):
            raise ValueError(f"levels must be an integer in 1..{len(self.levels)} (the engine's draft levels), "
                             f"got {levels!r}")
        chain = self.levels[:levels]
        per_level = list(draft_max) if isinstance(draft_max, (list, tuple)) else [draft_max]
        if len(per_level) > max(1, len(chain)):
            raise ValueError(f"draft_max lists {len(per_level)} levels, the chain has {len(chain)}")
        d = DEFAULT_DRAFT_PARAMS
        default_k = d.draft_max if params.greedy else DEFAULT_SAMPLING_DRAFT_MAX
        per_level += [None] * (max(1, len(chain)) - len(per_level))
        per_level = [default_k if k is None else k for k in per_level]
        dp = DraftParams(draft_max=per_level[0],
                         draft_min=d.draft_min if draft_min is None else draft_min,
                         draft_p_min=d.draft_p_min if draft_p_min is None else float(draft_p_min))
        for i, k in enumerate(per_level[1:], start=2):
            try:
                DraftParams(draft_max=k)
            except ValueError as e:
                raise ValueError(f"draft level {i}: {e}") from None
        ids = self.encode_prompt(prompt, chat)
        if len(ids) + max_new_tokens > self.ctx_size:
            what = "the model's context" if self.ctx_size == self.cfg.max_seq_len else "the context size"
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds {what} "
                f"of {self.ctx_size} tokens")
        emitted: list[int] = []  # kept across preemptions: a restart continues after them
        while True:
            seq = self.batcher.open(len(ids) + len(emitted))
            be = SeqBackend(self.batcher, seq)
            try:
                for t in self._run(be, seq, ids + emitted, max_new_tokens - len(emitted), params, stats,
                                   speculative, chain, per_level, dp, tp, lookup):
                    emitted.append(t)
                    self.batcher.pause(seq)
                    try:
                        yield t
                    finally:
                        self.batcher.resume(seq)
                return
            except Preempted:
                if not self.batcher.others(seq):
                    raise ContextMemoryError(
                        f"prompt ({len(ids)} tokens) + {len(emitted)} new tokens do not fit in the KV cache's "
                        f"budget of {self.batcher.pool.max_pages * self.batcher.pool.page_size} tokens") from None
                stats["preemptions"] = stats.get("preemptions", 0) + 1
            finally:
                self.batcher.close(seq)

    def _run(self, be: SeqBackend, seq, ids: list[int], max_new_tokens: int, params: SamplingParams,
             stats: dict, speculative: bool, chain: list, per_level: list, dp: DraftParams,
             tp: TreeParams, lookup: str) -> Iterator[int]:
        """One sequence's generation: prefill `ids`, then decode (speculative or plain)."""
        first = self._prefill(be, seq, ids, len(ids) + max_new_tokens, stats)
        if speculative and chain and max_new_tokens > 1:
            names = tuple(lv.name for lv in chain)
            ks: list[int | None] = [None]
            # K is chosen per batch size class, the one of each round (be.batch()): the cost
            # models of the classes the sequence passes through as others join and leave
            costs: list[Callable[[], CostModel] | None] = [None]
            for i, k in enumerate(per_level, start=1):
                k_min = dp.draft_min if i == 1 else 1
                ks.append(dp.k_cap if i == 1 else (DRAFT_MAX_LIMIT if k == "auto" else k))
                costs.append(self._class_cost_model(be, i, names, ks[-1], k_min, params.greedy) if k == "auto" else None)
            levels = [lv.bind(be) if isinstance(lv, MXLevel) else lv for lv in chain]
            run = Chain([MXLevel(be, 0, "target")] + levels, ks, costs, params, dp,
                        self._tree(tp, chain, names, params.greedy, per_level[0], be.batch),
                        self._lookup(lookup, chain, names, params.greedy, be.batch))
            yield from run.tokens(be, first, max_new_tokens, self.eos_ids, list(ids), stats)
        else:
            yield from self._plain(be, first, max_new_tokens, params, stats)

    def _tree(self, tp: TreeParams, chain: list, names: tuple, greedy: bool, k, batch: Callable[[], int]):
        """(TreeParams, a function giving the TreeCost of the batch size class `batch()`, or None)
        for Chain, or None for today's chain (also for "auto" over a chain of several levels: the
        tree is drafted by level 1 alone). A fixed draft_max K is the tree's depth unless
        tree_depth is given (capped by tree_nodes - 1)."""
        if tp.depth is None and isinstance(k, int):
            tp = replace(tp, depth=min(k, tp.nodes - 1) if tp.nodes is not None else k)
        if tp.mode == "off" or tp.mode == "auto" and len(chain) > 1:  # auto: single-level chains only
            return None
        if not isinstance(chain[0], MXLevel) or "tree" not in inspect.signature(self.backend.forward).parameters:
            if tp.mode == "on":
                raise ValueError("tree drafting needs an MX draft at level 1 on a backend with tree passes "
                                 "(tree='on')")
            return None
        if not greedy:  # seeded sampling stays reproducible: no timing-based choice (auto = the chain)
            return (tp, None) if tp.mode == "on" else None

        def cost() -> TreeCost:
            key = ("tree", tp, names, batch())
            if key not in self._tree_costs:
                self._tree_costs[key] = TreeCost(tp, chain_ok=True)
            return self._tree_costs[key]
        return tp, cost

    def _lookup(self, mode: str, chain: list, names: tuple, greedy: bool, batch: Callable[[], int]):
        """A function giving the Lookup of the batch size class `batch()` (qspec/lookup.py), or None:
        lookup off, sampling, level 1 not an MX draft, an n-gram level in the chain already, or a
        backend without tree passes."""
        if mode == "off" or not greedy or not isinstance(chain[0], MXLevel) \
                or any(isinstance(lv, NgramLevel) for lv in chain) \
                or "tree" not in inspect.signature(self.backend.forward).parameters:
            return None

        def get() -> Lookup:
            key = ("lookup", names, batch())
            if key not in self._lookups:
                self._lookups[key] = Lookup()
            return self._lookups[key]
        return get

    def _class_cost_model(self, be: SeqBackend, level: int, chain: tuple[str, ...], k_cap: int, k_min: int,
                          greedy: bool) -> Callable[[], CostModel]:
        """The cost model of a sequence's level, as a function of the batch size class it runs in
        at each call (be.batch())."""
        return lambda: self._cost_model(level, chain, k_cap, k_min, greedy, be.batch())

    def _cost_model(self, level: int, chain: tuple[str, ...], k_cap: int, k_min: int, greedy: bool,
                    batch: int = 1) -> CostModel:
        """draft_max="auto": one cost model per level, chain setting and batch size class (1, 2,
        4, .. sequences running: a verify row costs more when the batch already fills the GEMMs)
        for the engine's life, so that what one generation measured (step costs, acceptance)
        serves the next."""
        key = (k_cap, k_min, greedy, level, chain, batch)
        if key not in self._cost_models:
            below = self.levels[level - 2].bytes if level > 1 else MXLevel(self.backend, 0, "target").bytes
            # level 1 is the draft the user chose (draft=None turns it off) and drafts at least
            # draft_min tokens when the sequence runs alone; the levels added above it, an n-gram
            # level, and level 1 beside other sequences (whose rows already fill the verify GEMMs)
            # are skipped when they do not pay for themselves
            skippable = level > 1 or chain[level - 1] == NGRAM or batch > 1
            self._cost_models[key] = CostModel(self.levels[level - 1].bytes / below, k_cap, k_min, skippable, batch)
        return self._cost_models[key]

    def memory(self, tokens: int | None = None) -> str:
        """One line: the KV cache's memory at `tokens` positions (default: the context size) and
        the memory available (qspec/memory.py)."""
        from .memory import describe

        return describe(self.cfg, self.ctx_size if tokens is None else tokens,
                        getattr(getattr(self.backend, "pool", None), "draft_copy", None))

    def _prefill(self, be: SeqBackend, seq, ids: list[int], capacity: int, stats: dict[str, float]) -> np.ndarray:
        """Fill the sequence's cache with the prompt's rows; the logits of its last position.

        Rows the pool's prefix cache holds for a leading part of `ids` (target rows of the same
        ids, same kernels; qspec/kv_cache.py) are adopted: only the rest is run, and at least the
        last token, for its logits. Every op is batch-invariant, so this is bit-identical to a
        full prefill. The prompt goes in passes of at most PREFILL_ROWS rows (bounded memory),
        with other sequences running in chunks of about one step's rows (Batcher.prefill_chunk),
        so their streams keep going."""
        kv = be.kv
        t0 = time.perf_counter()
        reused = kv.adopt(ids, getattr(self.backend, "kernel_path", None))
        pos = reused
        while pos < len(ids):
            end = min(len(ids), pos + self.batcher.prefill_chunk(seq))
            logits = be.forward(ids[pos:end], pos, prefill=True)[-1]
            kv.length = pos = end
        stats.update(prompt_tokens=len(ids), prefill_s=time.perf_counter() - t0, cached_prompt_tokens=reused,
                     kv_bytes=kv.bytes_per_position * capacity)
        return logits

    def _plain(self, be: SeqBackend, logits: np.ndarray, max_new: int, params: SamplingParams,
               stats: dict[str, float]) -> Iterator[int]:
        """Plain autoregressive decoding after the prefill: one target forward per token."""
        kv = be.kv
        gen = None if params.greedy else params.generator()
        n, t_start = 0, time.perf_counter()
        try:
            while True:
                tok = argmax(logits) if gen is None else sample(warp(logits, params), gen)
                n += 1
                yield tok
                if tok in self.eos_ids or n == max_new:
                    break
                logits = be.forward([tok], kv.length)[-1]
                kv.length += 1
        finally:  # also when the caller closes the generator early: stats of what was emitted
            decode_s = time.perf_counter() - t_start
            stats.update(new_tokens=n, decode_s=decode_s,
                         tokens_per_s=(n - 1) / decode_s if decode_s > 0 else 0.0)


def check_ctx_size(ctx_size, cfg: ModelConfig) -> int:
    """`ctx_size` as an int in 1..the model's context, else ContextSizeError (a ValueError)."""
    if isinstance(ctx_size, bool) or not isinstance(ctx_size, (int, np.integer)) or ctx_size < 1:
        raise ContextSizeError(f"ctx_size must be an integer >= 1, got {ctx_size!r}")
    if ctx_size > cfg.max_seq_len:
        raise ContextSizeError(f"ctx_size {ctx_size} exceeds the model's context of {cfg.max_seq_len} tokens")
    return int(ctx_size)
