"""Tokenizers rebuilt from a GGUF's vocabulary (tokenizer.ggml.*) with the `tokenizers` library.

llama.cpp keeps no tokenizer.json: a GGUF holds the tokens, their types and either BPE merges
(tokenizer.ggml.model "gpt2", byte-level BPE) or SentencePiece scores ("llama": BPE over "▁"-
spelled pieces with byte fallback, as Llama, Gemma and Phi-3 ship it). The result must encode
exactly as transformers' own GGUF tokenizer load (transformers/integrations/gguf/
gguf_tokenizer_mapping.py), which tests/test_convert.py checks; transformers is only a test
dependency, so the construction is reproduced here:
- gpt2: BPE over the vocabulary and merges, the pre-tokenizer regex named by tokenizer.ggml.pre.
- llama (SentencePiece): merges are recovered from the vocabulary (every split of a token into two
  tokens), best first by the token's score; for Gemma by the token's position instead (Gemma's
  scores do not follow its merge order), after respelling tokens of 2+ spaces with "▁" (Gemma's
  GGUF stores them as real spaces). Normalizer, pre-tokenizer and decoder per family: Gemma
  replaces " " with "▁" and adds no prefix space; Phi-3 prepends "▁" in the normalizer; others
  use Metaspace (prefix "▁" on the first piece) and strip it when decoding.
- Both: tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens
  (matched whole); BOS/EOS are added as tokenizer.ggml.add_bos_token/add_eos_token say
  (SentencePiece vocabularies add BOS when the key is missing, as llama.cpp does).
"""

from __future__ import annotations

from qspec.errors import ModelLoadError
from qspec.gguf_arch import field, require

# Pre-tokenizer regexes of the BPE tokenizers we rebuild, keyed by tokenizer.ggml.pre.
# GPT-2's pattern is the one tokenizers' ByteLevel(use_regex=True) applies itself.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"default", "gpt-2", "gpt2"}
# llama.cpp splits every digit on its own, then applies GPT-2's pattern (StarCoder family).
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_SPLIT_PRE = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4



def _token_strings(reader) -> tuple[list[str], list[int]]:
    tokens = require(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    return list(tokens), [int(x) for x in types]


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ModelLoadError(f"unsupported GGUF tokenizer pre-tokenizer '{pre}'")


def _bpe_tokenizer(reader):
    """llama.cpp's byte-level BPE vocabulary (tokenizer.ggml.model = gpt2) as a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models

    tokens, types = _token_strings(reader)
    merges = [tuple(m.split(" ", 1)) for m in require(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError("GGUF tokenizer.ggml.merges has an entry without a space")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, types, user_defined_in_vocab=False)
    return tok, tokens


_SPACE = "\u2581"  # SentencePiece's visible space
_GEMMA_FAMILY = {"gemma", "gemma2", "gemma3"}


def _spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: each token's splits into two tokens,
    highest score first, ties by the longer left then right piece (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _spm_tokenizer(reader, arch: str):
    """A SentencePiece vocabulary (tokenizer.ggml.model = llama) as a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types = _token_strings(reader)
    gemma = arch in _GEMMA_FAMILY
    if gemma:
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        values = require(reader, "tokenizer.ggml.scores")
        if len(values) != len(tokens):
            raise ModelLoadError("GGUF tokenizer.ggml.scores and tokens differ in length")
        scores = dict(zip(tokens, (float(v) for v in values)))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = "<unk>" if gemma else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(vocab, scores), fuse_unk=True, unk_token=unk,
                               byte_fallback=True, dropout=None))
    sequence = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(prepend=_SPACE), normalizers.Replace(" ", _SPACE)])
        sequence.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
        sequence.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(sequence)
    _add_marked_tokens(tok, tokens, types, user_defined_in_vocab=True)
    return tok, tokens


def _add_marked_tokens(tok, tokens: list[str], types: list[int], user_defined_in_vocab: bool) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens (a
    SentencePiece vocabulary: only those still spelled as in its vocabulary)."""
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == _TOKEN_TYPE_USER_DEFINED]
    if user_defined_in_vocab:
        vocab = tok.get_vocab()
        user = [a for a in user if a.content in vocab]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def build_tokenizer(reader, arch: str, ids: dict):
    """(tokenizers.Tokenizer, token strings, add_bos, add_eos) for the GGUF's vocabulary;
    `ids`: the bos/eos token ids (or None)."""
    from tokenizers import processors

    kind = require(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        tok, tokens = _bpe_tokenizer(reader)
    elif kind == "llama":
        tok, tokens = _spm_tokenizer(reader, arch)
    else:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model '{kind}' (supported: gpt2 (BPE), llama (SentencePiece))")
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = ids.get("bos"), ids.get("eos")
    single, pair, special = "$A", "$A:0 $B:1", []
    if add_bos and bos_id is not None:
        single, pair = f"{tokens[bos_id]} {single}", f"{tokens[bos_id]} $A:0 {tokens[bos_id]}:1 $B:1"
        special.append((tokens[bos_id], bos_id))
    if add_eos and eos_id is not None:
        single, pair = f"{single} {tokens[eos_id]}", f"{pair} {tokens[eos_id]}:1"
        special.append((tokens[eos_id], eos_id))
    if special:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tokens, add_bos, add_eos
