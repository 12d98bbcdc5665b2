"""Tokenizer (the `tokenizers` library) + chat template (jinja2, rendered as transformers does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .errors import ModelLoadError

TemplateError = jinja2.exceptions.TemplateError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialized form
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ModelLoadError(f"{path}: invalid tokenizer ({str(e).splitlines()[0]})") from None
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise_exception
            try:
                self._compiled = env.from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise ModelLoadError(f"{cfg_path}: invalid chat template ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def end_marker_ids(self) -> set[int]:
        """Special tokens that end a document or a turn in any common template (END_MARKERS):
        models emit them even when the config names only one as EOS (Qwen2.5 ends with either
        <|im_end|> or <|endoftext|>); llama.cpp stops at them too."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special and t.content in END_MARKERS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            raise ValueError("this model has no chat template")
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        # transformers tokenizes a rendered template without adding special tokens again
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def encode_chat(self, prompt: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": prompt}])


END_MARKERS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                         "<end_of_turn>", "<EOT>", "<｜end▁of▁sentence｜>"})


class StreamDecoder:
    """Turns a growing token list into text pieces without splitting multi-byte characters, at a
    cost per token independent of the text's length (decoding the whole list at every token
    took 1.35 ms a token at 8,000 tokens, 5.4 s over such a stream). Each step decodes a window:
    the tokens not yet turned into text and the ones of the piece before them, whose context
    keeps word-boundary rules (SentencePiece's leading space, byte-level merges) as the whole
    list's decode applies them; the piece is what the window adds to that context's text (the
    incremental detokenizer of Hugging Face's TGI and vLLM). The pieces and `finish()` add up to
    tokenizer.decode(tokens) (tests/test_server.py, test_convert_arch.py: byte-level BPE and
    SentencePiece). One exception, as with any streaming: a run of SentencePiece byte tokens
    (<0xXX>) that is not valid UTF-8 decodes as one U+FFFD a byte, so the characters its valid
    start already gave are not taken back."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # the window's first token: context, already emitted
        self._read = 0    # tokens before this are emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._piece(final=False)

    def finish(self) -> str:
        """What is held back at the end (an incomplete UTF-8 sequence decodes as U+FFFD, as in
        the whole list's decode)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        head = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        # an incomplete UTF-8 sequence, or a token with no text yet: wait for the next token
        if not final and (text.endswith("\ufffd") or len(text) <= len(head)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(head):]


class TextStream:
    """Token ids -> text deltas: whole characters only, cut before the first stop string.

    While streaming, a tail of the text that could be the start of a stop string is held back
    until the next tokens show whether it is one. The concatenated deltas equal
    tokenizer.decode(tokens) cut at the first stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self._dec = StreamDecoder(tokenizer)
        self._stops = stops
        self._pending = ""  # text held back: a possible start of a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        piece = self._dec.push(token)
        return self._take(piece) if piece else ""

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        if self.stopped:
            return ""
        out = self._take(self._dec.finish())
        rest, self._pending = self._pending, ""
        return out + ("" if self.stopped else rest)

    def _take(self, piece: str) -> str:
        buf = self._pending + piece
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[:min(hits)]
        hold = max((k for s in self._stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]
