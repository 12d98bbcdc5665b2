"""Long prompts from real documents, built at run time without a network: Python standard-library
source files (present on every machine that runs qspec) from their first top-level def or class
on, cut to a token budget at a line boundary, followed by a question about a function that the
kept part defines. Deterministic for a given
Python installation and tokenizer.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

# modules with long, ordinary source (one file each), in a fixed order
SOURCES = ("argparse", "difflib", "textwrap", "tarfile", "zipfile/__init__", "configparser", "heapq",
           "shutil", "pathlib/_local", "pathlib", "statistics", "fractions", "calendar", "inspect", "ftplib",
           "smtplib", "imaplib", "pickle", "gettext", "pprint", "csv", "ast", "logging/__init__", "email/message")
QUESTION = ("\n\nThe text above is part of the Python standard library file {name}.py. "
            "In two or three sentences, what does the function `{func}` defined there do?")


def source_files() -> list[tuple[str, Path]]:
    """(name, path) of the SOURCES this Python has, one per top-level module."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    for name in SOURCES:
        f, top = root / f"{name}.py", name.split("/")[0]
        if f.is_file() and top not in seen:
            seen.add(top)
            out.append((name, f))
    return out


def long_prompts(engine, n_tokens: int, count: int) -> list[list[int]]:
    """`count` prompts (chat-templated token ids when the model has a template) of about
    `n_tokens` tokens each (never more): a source file's first lines and a question about one of
    the functions they define. Raises SystemExit when the files are too short for n_tokens."""
    prompts = []
    for name, path in source_files():
        if len(prompts) == count:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        first = re.search(r"^(def|class) ", text, flags=re.M)
        text = text[first.start():] if first else text
        ids = _fit(engine, text, name, n_tokens)
        if ids is not None:
            prompts.append(ids)
    if len(prompts) < count:
        raise SystemExit(f"bench: error: only {len(prompts)} standard-library files give {n_tokens}-token "
                         f"prompts (asked for {count})")
    return prompts


def _fit(engine, text: str, name: str, n_tokens: int) -> list[int] | None:
    """The longest prefix of `text`, cut at a line end, whose prompt fits n_tokens (None: the file is too short)."""
    tok = engine.tokenizer
    overhead = len(engine.encode_prompt(QUESTION.format(name=name, func="x" * 12)))
    body = tok.encode(text)
    if len(body) < n_tokens - overhead:
        return None
    cut = tok.decode(body[:max(1, n_tokens - overhead - 16)])
    cut = cut[:cut.rfind("\n") + 1] or cut
    funcs = re.findall(r"^\s*def ([A-Za-z_]\w*)\(", cut, flags=re.M)
    if not funcs:
        return None
    func = funcs[len(funcs) // 2]  # one from the middle of the kept part
    ids = engine.encode_prompt(cut + QUESTION.format(name=name, func=func))
    while len(ids) > n_tokens:  # a template or a merge across the cut added tokens: drop lines
        cut = cut[:cut.rstrip("\n").rfind("\n") + 1]
        ids = engine.encode_prompt(cut + QUESTION.format(name=name, func=func))
    return ids
