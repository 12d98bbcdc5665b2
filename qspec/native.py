"""Engine backend on the native kernels: weights packed once, one C++ call per forward.

Packing reads the BF16 checkpoint with torch (imported here only then); with the packed weights
mapped from the weight cache or a draft file, a backend is built and run on numpy alone."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from . import _C
from .config import ModelConfig
from .draft import DraftSpec, _read_header, pack_mx_matrix
from .errors import DraftFileError, ModelLoadError
from .batch import Pass
from .kv_cache import KVCache, KVPool
from .loader import ModelWeights, _weight_files, layer_norm_names
from .memory import page_aligned_empty
from .parallel.shard import Shard
from .rope import rope_tables

TARGET, DRAFT = 0, 1

# The MX drafts' KV (qspec/kv_cache.py): "int8" / "int4" = they read that copy of the cache
# (csrc/kv_q8.h), "bf16" = the BF16 rows (no copy kept), "auto" = the DRAFT_KV_AUTO_FORMAT copy is
# kept and read by draft passes from DRAFT_KV_AUTO_MIN positions on, where reading fewer bytes pays
# (README, "Long prompts").
DRAFT_KV_MODES = ("auto", "int8", "int4", "bf16")
# INT4 (K per channel over pages, rotated V): 28.1% of the BF16 cache's bytes, and at 8k tokens the
# 1.5B's drafts accept as much over it as over the INT8 copy (51.8%) and nearly as much as over the
# BF16 rows; its kernel does more work per key than the INT8 one (~4% of the 8k speedup on a 2-core
# AMX VM), for half the bytes (README, "Long prompts").
DRAFT_KV_AUTO_FORMAT = "int4"
DRAFT_KV_AUTO_MIN = 1024
# Keys at the start of the context that a windowed draft pass attends besides its window (the
# "attention sinks" of StreamingLLM: the first tokens draw attention whatever they hold).
DRAFT_SINKS = 64
# The window `draft_window=None` gives when the cache keeps a draft copy: at 8k tokens over the INT4
# copy (README, "Long prompts"), in one run with auto K: the drafts attending every key 1.56x
# (acceptance 0.86, c 0.45), a 4,096-key window 1.29x (0.63, c 0.39), 2,048 keys 1.24x (0.41, c
# 0.34): the keys a window drops cost more acceptance than the copy's bytes cost time. 8,192 keeps
# every key up to 8k and bounds a draft step's attention beyond (at 32k not measured).
DEFAULT_DRAFT_WINDOW = 8192
# The latest keys of each row that draft passes over the copy read from the BF16 rows instead
# (csrc/attention.h recent_keys): the copy's error costs the drafts most where their attention
# weight is. Qwen2.5-Coder-1.5B at 8k tokens over the INT4 copy, K = 4, 3 prompts x 64 greedy
# tokens: acceptance 0.813 with none, 0.846 with 64, 0.881 with 256 (as over the BF16 rows: 0.881),
# 0.888 with 1,024; 256 keys add ~11% to the bytes a draft step reads from the copy at 8k.
DRAFT_RECENT_KEYS = 256
# The sparse draft attention's budget `draft_sparse=None` gives with a draft copy (csrc/draft_pages.cpp:
# over the INT4 copy each draft row attends about N keys of its written pages, those whose
# per-channel bounds allow the highest scores, besides its recent keys; 0: every page). At 8k
# tokens (Qwen2.5-Coder-1.5B, AMX Xeon VM, 3 prompts x 64 greedy tokens, auto K, one run side by
# side) every page 1.71x (c 0.339), 2,048 keys 1.88x (c 0.293), 4,096 keys 1.79x (c 0.316); at K = 4
# the drafts accepted 0.881 / 0.827 / 0.896 (README, "Long prompts"). Below ~2.4k tokens it
# changes nothing.
DEFAULT_DRAFT_SPARSE = 2048


def check_draft_sparse(draft_sparse, copy: str | None) -> int:
    """`draft_sparse` as an int: 0 (the drafts attend every page) or N >= 256 (passes over the INT4
    draft copy attend about N keys of each row's written pages, the rest of its keys as they are);
    a budget needs the copy. None: DEFAULT_DRAFT_SPARSE."""
    if draft_sparse is None:
        return DEFAULT_DRAFT_SPARSE if copy is not None else 0
    if isinstance(draft_sparse, bool) or not isinstance(draft_sparse, int) or not (
            draft_sparse == 0 or draft_sparse >= 256):
        raise ValueError(f"draft_sparse must be 0 or an integer >= 256, got {draft_sparse!r}")
    if draft_sparse and copy is None:
        raise ValueError("sparse draft attention needs a draft KV copy (an MX draft with draft KV int4 or auto)")
    return draft_sparse


def check_draft_window(draft_window, copy: str | None) -> int:
    """`draft_window` as an int: 0 (the drafts attend every key) or N >= 1 (passes over the draft
    copy attend the DRAFT_SINKS first keys and the N most recent ones); a window needs the copy.
    None: DEFAULT_DRAFT_WINDOW with a copy, else 0."""
    if draft_window is None:
        return DEFAULT_DRAFT_WINDOW if copy is not None else 0
    if isinstance(draft_window, bool) or not isinstance(draft_window, int) or draft_window < 0:
        raise ValueError(f"draft_window must be an integer >= 0, got {draft_window!r}")
    if draft_window and copy is None:
        raise ValueError("a draft window needs a draft KV copy (an MX draft with draft KV int8, int4 or auto)")
    return draft_window


def draft_copy_format(cfg: ModelConfig, draft_kv: str, draft) -> str | None:
    """The draft copy the KV cache keeps ("int8", "int4"), or None: none without a draft, for
    draft_kv "bf16", or with head_dim not a multiple of 32 (then the drafts read the BF16 rows).
    "auto" keeps the INT8 copy where the INT4 one cannot hold the heads (head_dim > 512)."""
    if draft_kv not in DRAFT_KV_MODES:
        raise ValueError(f"draft_kv must be one of {', '.join(DRAFT_KV_MODES)}, got {draft_kv!r}")
    if draft is None or draft_kv == "bf16" or cfg.head_dim % 32:
        return None
    if draft_kv == "auto":
        return "int8" if DRAFT_KV_AUTO_FORMAT == "int4" and cfg.head_dim > 512 else DRAFT_KV_AUTO_FORMAT
    return draft_kv


def check_tree(tree, start_pos: int, m: int) -> np.ndarray:
    """Validates `tree = (prefix, parents)` for a pass writing slots start_pos .. start_pos + m - 1.

    prefix P: committed length, 0 <= P <= start_pos. parents: one int per slot s in
    [P, start_pos + m), the slot of s's parent or -1 for a root, with P <= parent < s.
    Returns parents as int64; raises ValueError naming the first problem."""
    try:
        prefix, parents = tree
    except (TypeError, ValueError):
        raise ValueError("tree must be a pair (prefix, parents)") from None
    if isinstance(prefix, bool) or not isinstance(prefix, (int, np.integer)):
        raise ValueError(f"tree prefix must be an int, got {type(prefix).__name__}")
    prefix = int(prefix)
    if not 0 <= prefix <= start_pos:
        raise ValueError(f"tree prefix {prefix} must be in [0, start_pos={start_pos}]")
    par = np.asarray(parents)
    if par.ndim != 1 or (par.size and par.dtype.kind not in "iu"):
        raise ValueError("tree parents must be a 1-D sequence of ints")
    par = par.astype(np.int64)
    if par.size != start_pos + m - prefix:
        raise ValueError(f"tree parents has {par.size} entries, expected start_pos + m - prefix = "
                         f"{start_pos + m - prefix} (one per slot {prefix}..{start_pos + m - 1})")
    slots = np.arange(prefix, start_pos + m)
    bad = np.flatnonzero((par != -1) & ((par < prefix) | (par >= slots)))
    if bad.size:
        s = int(slots[bad[0]])
        raise ValueError(f"tree parent {int(par[bad[0]])} of slot {s} must be -1 or a slot in [{prefix}, {s})")
    return par


def bf16_numpy(t) -> np.ndarray:
    """Zero-copy uint16 view of a contiguous BF16 torch tensor (the one place bf16 crosses to _C)."""
    import torch

    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")  # LayerWeights fields


def small_names(cfg: ModelConfig) -> tuple[str, ...]:
    """A layer's float32 vectors: the norms its family has (replicated under tensor parallelism),
    then "bqkv" with attention biases (q/k/v bias)."""
    have = layer_norm_names(cfg)
    return tuple(k for k in NORMS if k in have) + (("bqkv",) if cfg.attention_bias else ())


def _layer_names(cfg: ModelConfig, small: bool) -> list[str]:
    extra = small_names(cfg) if small else ()
    return [f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in extra + MATRICES]


def target_names(cfg: ModelConfig) -> list[str]:
    """What the packed target holds: every layer's norms (and q/k/v bias) as float32 vectors and
    its four GEMM operands packed BF16, then the final norm and the LM head. With the small
    tensors in the same file, a load from the cache reads nothing scattered in the checkpoint."""
    return _layer_names(cfg, True) + ["norm", "lm_head"]


def draft_names(cfg: ModelConfig, spec: DraftSpec) -> list[str]:
    return _layer_names(cfg, False) + (["lm_head"] if spec.lm_head != "bf16" else [])


def pack_target(weights: ModelWeights, shard: Shard) -> Iterator[tuple[str, object]]:
    """The packed target (of `shard`'s part of the model), one entry at a time (the names of target_names)."""
    for i, lw in enumerate(weights.layers):
        for k in NORMS:  # the loader fills those of small_names(cfg); replicated on every rank
            if getattr(lw, k) is not None:
                yield f"layers.{i}.{k}", getattr(lw, k).float().numpy()
        bias = shard.layer_bias(lw)
        if bias is not None:
            yield f"layers.{i}.bqkv", bias.numpy()
        for k, w in shard.layer_matrices(lw).items():
            yield f"layers.{i}.{k}", _C.pack_bf16(bf16_numpy(w))
    yield "norm", weights.norm.float().numpy()
    yield "lm_head", _C.pack_bf16(bf16_numpy(shard.lm_head(weights.lm_head)))


def cast_draft_matrices(weights: ModelWeights, spec: DraftSpec, shard: Shard) -> Iterator[tuple[str, object]]:
    """The draft's packed MX matrices (of `shard`'s part of the model), one at a time, by the
    drafts' cast (qspec.draft.cast_rule) of the target's own BF16 weights."""
    for i, lw in enumerate(weights.layers):
        for k, w in shard.layer_matrices(lw).items():
            yield f"layers.{i}.{k}", pack_mx_matrix(w, spec.fmt)
    if spec.lm_head != "bf16":
        yield "lm_head", pack_mx_matrix(shard.lm_head(weights.lm_head), spec.lm_head)


def cast_draft(weights: ModelWeights, spec: DraftSpec, shard: Shard) -> dict:
    """cast_draft_matrices as one dict."""
    return dict(cast_draft_matrices(weights, spec, shard))


def _progress(items: Iterable, total: int, desc: str) -> Iterator:
    """`items` with a progress bar on stderr (when it is a terminal)."""
    from tqdm import tqdm

    with tqdm(items, total=total, desc=desc, unit="matrix", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty()) as bar:
        yield from bar


def map_checkpoint_tensor(model_dir: Path, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """Read-only uint16 memory map of a tensor stored as BF16 in the checkpoint (no copy), or None
    when it is stored in another dtype. The pages are read when used: an embedding lookup
    touches only the rows of the tokens seen."""
    for f in _weight_files(model_dir):
        try:
            header, start = _read_header(f)
        except DraftFileError:
            return None
        info = header.get(name)
        if isinstance(info, dict):
            lo, hi = info["data_offsets"]
            if info.get("dtype") != "BF16" or tuple(info.get("shape", ())) != shape or hi - lo != 2 * np.prod(shape):
                return None
            return np.memmap(f, dtype=np.uint16, mode="r", offset=start + lo, shape=shape)
    return None


def native_backend(model_dir: Path, cfg: ModelConfig, weights: ModelWeights, draft: DraftSpec | None = None,
                   draft_packed: dict | None = None, cache: bool | None = None,
                   upper_drafts: Sequence[DraftSpec] = (), shard: Shard | None = None,
                   draft_kv: str = "bf16", draft_window: int | None = 0,
                   draft_sparse: int | None = 0) -> "NativeBackend":
    """A NativeBackend whose packed target (and draft, unless `draft_packed` comes from a draft
    file) are memory-mapped from the weight cache (qspec/weight_cache.py) when it has them, else
    packed/cast here, with a progress bar, and written to the cache for the next load.
    `upper_drafts`: MX formats of the draft levels above the draft (weight sets 2, 3, ...), got the same way.
    `cache`: None = on unless QSPEC_NO_WEIGHT_CACHE is set. `backend.load_info` says what happened.
    `shard`: the part of the model a tensor-parallel rank holds (qspec/parallel; default: all of it);
    its packed weights are cached under kinds of their own."""
    from .weight_cache import WeightCache, cache_enabled, draft_kind

    t0 = time.perf_counter()
    shard = shard or Shard.plan(cfg)
    info: dict = {}
    wc = WeightCache(model_dir) if cache_enabled(cache) else None
    estimate = int(wc.identity["weight_bytes"]) if wc is not None else 0

    def get(what: str, kind: str, fmt: str, lm_head: str, names: list[str], make, size: int, desc: str) -> dict:
        t = time.perf_counter()
        kind += shard.tag
        how, packed = "cache", wc.load(kind, fmt, lm_head) if wc is not None else None
        if packed is None and wc is not None:  # stream into the cache file, then map it
            how, packed = "built+cached", wc.store(kind, fmt, lm_head, names,
                                                   _progress(make(), len(names), desc), size)
        if packed is None:  # no cache, or it could not be written
            how, packed = "built", dict(_progress(make(), len(names), desc))
        info[what], info[f"{what}_s"] = how, time.perf_counter() - t
        return packed

    target = get("target", "target", "bf16", "bf16", target_names(cfg), lambda: pack_target(weights, shard), estimate // shard.world,
                 "qspec: packing BF16 weights")
    if draft is not None and draft_packed is None:
        draft_packed = get("draft", draft_kind(draft), draft.fmt, draft.lm_head, draft_names(cfg, draft),
                           lambda: cast_draft_matrices(weights, draft, shard), estimate // (2 * shard.world),
                           f"qspec: casting the {draft.fmt} draft")
    elif draft_packed is not None:
        info["draft"] = "file"
    upper = [(spec, get(f"draft{i}", draft_kind(spec), spec.fmt, spec.lm_head, draft_names(cfg, spec),
                        lambda spec=spec: cast_draft_matrices(weights, spec, shard), estimate // (2 * shard.world),
                        f"qspec: casting the {spec.fmt} upper draft"))
             for i, spec in enumerate(upper_drafts, start=2)]
    embed = map_checkpoint_tensor(model_dir, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    info["embed"] = "mapped" if embed is not None else "copied"
    be = NativeBackend(cfg, weights, draft, draft_packed, target_packed=target, embed=embed, upper_drafts=upper,
                       shard=shard, draft_kv=draft_kv, draft_window=draft_window,
                       draft_sparse=draft_sparse)
    info["load_s"] = time.perf_counter() - t0
    be.load_info = info
    return be


class NativeBackend:
    """Target (BF16) and optional draft (MX) weight sets over one KV cache: set 0 the target, set 1
    the draft, sets 2.. the MX draft levels above it (qspec/levels.py)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, draft: DraftSpec | None = None,
                 draft_packed: dict | None = None, *, target_packed: dict | None = None,
                 embed: np.ndarray | None = None, upper_drafts: Sequence[tuple[DraftSpec, dict]] = (),
                 shard: Shard | None = None, draft_kv: str = "bf16", draft_window: int | None = 0,
                 draft_sparse: int | None = 0):
        """`target_packed` / `draft_packed` (target_names / draft_names -> PackedWeight or float32
        array, e.g. mapped from the weight cache or a draft file) are used as they are; otherwise
        the target is packed and `draft` cast here. `embed`: the BF16 bits of the embedding to
        borrow (a mapping of the checkpoint); otherwise a private copy of `weights.embed` is made.
        Nothing else is read from `weights` when both packed sets are given. `upper_drafts`:
        (format, packed matrices) of weight sets 2, 3, ... (needs `draft`). `shard`: the part of the
        model this tensor-parallel rank holds (default: all of it); its forward returns logits of
        its vocab rows only, and `set_reducer` must be given the reduction over the ranks.
        `draft_kv`: what the MX draft passes attend over (DRAFT_KV_MODES); `draft_window` and
        `draft_sparse`: see check_draft_window and check_draft_sparse (the properties)."""
        if upper_drafts and draft is None:
            raise ValueError("draft levels above the draft need a draft (weight set 1)")
        self.cfg = cfg
        self.shard = shard = shard or Shard.plan(cfg)
        local = shard.local_config(cfg)
        # this rank's KV heads: the pool of every sequence, and the one direct forward() calls use
        self.pool = KVPool(local, draft_copy=draft_copy_format(cfg, draft_kv, draft))
        self.draft = draft
        self.draft_kv = draft_kv
        self.kv = KVCache(self.pool)
        self.load_info: dict = {}
        if target_packed is None:
            target_packed = dict(pack_target(weights, shard))
        # the model borrows it: a mapping of the checkpoint, or a private copy (the checkpoint
        # mapping of `weights` closes after load)
        self._embed = embed if embed is not None else bf16_numpy(weights.embed.clone())
        self.target_bytes = self.draft_bytes = 0
        try:
            self.model = _C.Model(
                {"hidden_size": cfg.hidden_size, "intermediate_size": local.intermediate_size,
                 "n_layers": cfg.n_layers, "n_heads": local.n_heads, "n_kv_heads": local.n_kv_heads,
                 "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "lm_head_rows": shard.vocab_rows,
                 "rms_norm_eps": cfg.rms_norm_eps, "embed_scale": cfg.embed_scale, "rope_dim": cfg.rope_dim,
                 "hidden_act": cfg.hidden_act,
                 # unset: the model's own 1/sqrt(head_dim) in fp32 (a double's rounding may differ)
                 **({} if cfg.query_scale is None else {"attn_scale": cfg.query_scale})},
                self._embed, target_packed["norm"])
            for i in range(cfg.n_layers):
                p = f"layers.{i}."
                tgt = [target_packed[p + k] for k in MATRICES]
                self.model.set_layer(TARGET, i, *tgt)
                self.target_bytes += sum(w.nbytes for w in tgt)
                self.model.set_layer_norms(i, target_packed[p + "attn_norm"], target_packed[p + "mlp_norm"],
                                           target_packed.get(p + "bqkv"), target_packed.get(p + "q_norm"),
                                           target_packed.get(p + "k_norm"), target_packed.get(p + "post_attn_norm"),
                                           target_packed.get(p + "post_mlp_norm"))
                self.model.set_layer_attention(i, cfg.rope_table_of(i), cfg.window_of(i))
            self.lm_head = target_packed["lm_head"]
            self.model.set_lm_head(TARGET, self.lm_head)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"packed target weights do not match this model ({e})") from None
        self.target_bytes += self.lm_head.nbytes
        packed_draft = {}
        if draft is not None:
            packed_draft = draft_packed if draft_packed is not None else cast_draft(weights, draft, shard)
            self.draft_bytes = self._set_draft(DRAFT, packed_draft, DraftFileError, "draft file")
        self.draft_packed = packed_draft  # the draft matrices, as a draft file holds them
        # bytes each weight set streams per pass; [0] the target, [1] the draft, [2..] upper drafts
        self.set_bytes = [self.target_bytes] + ([self.draft_bytes] if draft is not None else [])
        self.upper_drafts = [spec for spec, _ in upper_drafts]
        for set_index, (spec, packed) in enumerate(upper_drafts, start=DRAFT + 1):
            self.set_bytes.append(self._set_draft(set_index, packed, ModelLoadError, f"{spec.fmt} draft"))
        self._rope_positions = 0
        self._logits = page_aligned_empty((0, shard.vocab_rows), np.float32)
        self._draft_window = check_draft_window(draft_window, self.pool.draft_copy)
        self.draft_sparse = draft_sparse  # sets both

    @property
    def draft_kv(self) -> str:
        """What the MX draft passes attend over (DRAFT_KV_MODES). The pool's draft copy is made at
        load, so a later change may only pick "bf16" (the drafts read the BF16 rows) or a mode
        whose copy the pool keeps."""
        return self._draft_kv

    @draft_kv.setter
    def draft_kv(self, mode: str) -> None:
        copy = draft_copy_format(self.cfg, mode, self.draft)  # ValueError for an unknown mode
        if copy is not None and copy != self.pool.draft_copy:
            raise ValueError(f"draft_kv {mode!r} needs the {copy} draft copy of the KV cache, and this engine keeps "
                             f"{self.pool.draft_copy or 'none'}: pass draft_kv to qspec.load")
        self._draft_kv = mode

    @property
    def draft_window(self) -> int:
        """0: the drafts attend every key; N: their passes over the draft copy attend the first
        DRAFT_SINKS keys and the N most recent ones (layers without a sliding window of their own),
        so a draft step's attention stops growing with the context. The target is untouched."""
        return self._draft_window

    @draft_window.setter
    def draft_window(self, n: int | None) -> None:
        self._draft_window = check_draft_window(n, self.pool.draft_copy)
        self.model.set_draft_attention(DRAFT_SINKS, self._draft_window, DRAFT_RECENT_KEYS, self._draft_sparse)

    @property
    def draft_sparse(self) -> int:
        """0: the drafts attend every page of the copy; N: over the INT4 copy each draft row attends
        about N keys of its written pages (those whose keys can score highest), besides its recent
        keys. The target is untouched."""
        return self._draft_sparse

    @draft_sparse.setter
    def draft_sparse(self, n: int | None) -> None:
        self._draft_sparse = check_draft_sparse(n, self.pool.draft_copy)
        self.model.set_draft_attention(DRAFT_SINKS, self._draft_window, DRAFT_RECENT_KEYS, self._draft_sparse)

    def _set_draft(self, set_index: int, packed: dict, error: type, what: str) -> int:
        """Load MX matrices into a weight set (the LM head is the target's unless `packed` has
        one); the bytes a pass of that set streams."""
        try:
            for i in range(self.cfg.n_layers):
                self.model.set_layer(set_index, i, *(packed[f"layers.{i}.{k}"] for k in MATRICES))
        except (KeyError, ValueError) as e:
            raise error(f"{what} does not match this model ({e})") from None
        self.model.set_lm_head(set_index, packed.get("lm_head", self.lm_head))
        return sum(p.nbytes for p in packed.values()) + (self.lm_head.nbytes if "lm_head" not in packed else 0)

    def _ensure_rope(self, n: int) -> None:
        if n > self._rope_positions:
            n = min(max(n, 2 * self._rope_positions, 256), max(n, self.cfg.max_seq_len))
            for table in sorted({0} | {self.cfg.rope_table_of(i) for i in range(self.cfg.n_layers)} - {-1}):
                self.model.set_rope(*rope_tables(self.cfg, n, table), table)
            self._rope_positions = n

    @property
    def kernel_path(self) -> str:
        """The ISA level the kernels run at now (QSPEC_ISA / set_isa_limit): rows' bits depend on it."""
        return _C.isa_selected()

    def forward(self, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False,
                draft: bool | int = False, tree: tuple[int, Sequence[int]] | None = None) -> np.ndarray:
        """Run `tokens` at positions start_pos.. of the backend's own sequence (`kv`); logits
        [m or 1, vocab rows], an array of the caller's. `draft`: the weight set to run: False/0
        the target, True/1 the draft, 2.. an upper draft.

        `tree = (prefix, parents)`: the rows are draft-tree nodes at slots start_pos.. (see
        check_tree and docs/architecture.md, "Tree attention"); each node's row is bit-identical
        to a one-row linear step over its path. Tree rows are not recorded for prefix reuse.
        Concurrent generations go through qspec/batch.py instead, which calls prepare and run."""
        p = self.prepare(self.kv, tokens, start_pos, all_logits=all_logits, draft=draft, tree=tree)
        with self.pool.lock:
            return self.run([p], int(draft))[0]

    def prepare(self, kv: KVCache, tokens: Sequence[int], start_pos: int, *, all_logits: bool = False,
                draft: bool | int = False, tree=None) -> Pass:
        """One sequence's rows for `run`: checks them, adds the pages they need and makes them
        writable (kv.writing)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        m = ids.size
        if m < 1:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
        if tree is not None:
            tree = (tree[0], check_tree(tree, start_pos, m))
        kv.ensure_capacity(start_pos + m)
        # every op is batch-invariant (docs/architecture.md): a target row's bits depend only on the
        # ids up to it, so they are recorded for reuse; draft rows are provisional MX rows, tree
        # rows sit at slots, not at their positions (KVCache.move_rows records accepted ones)
        kv.writing(start_pos, start_pos + m)
        return Pass(kv, ids.astype(np.int32), int(start_pos), all_logits, tree,
                    self.reads_draft_copy(draft, start_pos), target_rows=not draft and tree is None)

    def run(self, passes: Sequence[Pass], weight_set: int) -> list[np.ndarray]:
        """One native forward of `weight_set` over the passes' rows (the caller holds the pool
        lock); each pass's logits [m or 1, vocab rows], arrays of the caller's."""
        rows = sum(len(p.tokens) if p.all_logits else 1 for p in passes)
        if self._logits.shape[0] < rows:
            self._logits = page_aligned_empty((rows, self.shard.vocab_rows), np.float32)
        self._ensure_rope(max(p.start_pos + len(p.tokens) for p in passes))
        out = self._logits[:rows]
        tokens = passes[0].tokens if len(passes) == 1 else np.concatenate([p.tokens for p in passes])
        self.model.forward(tokens, [(len(p.tokens), p.start_pos, p.kv.page_table, p.all_logits, p.tree, p.draft_q8)
                                    for p in passes], self.pool.data, int(weight_set), out, self.pool.q8,
                           self.pool.page_size)
        path = self.kernel_path
        for p in passes:
            if p.target_rows:
                p.kv.recorded(p.start_pos, p.tokens, path)
        res, r = [], 0
        for p in passes:
            n = len(p.tokens) if p.all_logits else 1
            res.append(out[r:r + n].copy())  # the buffer is reused by the next call
            r += n
        return res

    def reads_draft_copy(self, draft: bool | int, start_pos: int) -> bool:
        """Whether a pass of weight set `draft` from `start_pos` attends over the draft copy."""
        if not draft or self.pool.q8 is None or self.draft_kv == "bf16":
            return False
        return self.draft_kv != "auto" or start_pos >= DRAFT_KV_AUTO_MIN
