"""The MX draft: the target's own weights cast to an MX format, and its `qspec quantize` file.

Only the GEMM weights are cast; embeddings, norms and (by default) the LM head are the target's
own, shared, not copied (DESIGN.md invariant 3: one weight source).

Packed file (safetensors, written atomically): one uint8 tensor per packed buffer, named
"<matrix>/<buffer>" where <matrix> is "layers.<i>.<wqkv|wo|w_gate_up|w_down>" or "lm_head";
a target file also holds the small tensors as F32 ("norm", "layers.<i>.attn_norm|mlp_norm|bqkv").
Metadata: qspec_draft_version (the packed-file version), pack_layout_version, kind ("draft", the
default, or "target" for the weight cache's BF16 file), format, lm_head, cast (a draft's: DRAFT_CAST), source (the
checkpoint's path, weight-file bytes, per-file size and mtime, config.json SHA-256), and
"matrices" = {matrix: [fmt, n, k]}. The header is padded with spaces so the data starts on a
page boundary. A `qspec quantize` draft file is this file of kind "draft"; one of another
version, layout, or checkpoint (weight bytes or config.json differ) is refused with DraftFileError.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _C
from .errors import DraftFileError

DRAFT_FORMATS = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3")
DRAFT_FILE_VERSION = 1
PAGE = 4096
# The drafts' cast: per block the closer of the spec's shared exponent and the one above
# (qspec/mx.py, rule "mse") for the 4- and 6-bit formats, the spec's own for MXFP8. Recorded in
# a draft file's metadata as "cast": the weight cache rebuilds a draft cast otherwise; a
# `qspec quantize` file of an older cast still loads (any cast drafts losslessly).
DRAFT_CAST = "mse"


def cast_rule(fmt: str) -> str:
    """The mx.quantize rule the drafts' cast of MX format `fmt` uses."""
    return DRAFT_CAST if fmt in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2") else "ocp"


@dataclass(frozen=True)
class DraftSpec:
    fmt: str = "mxfp4"
    lm_head: str = "bf16"  # "bf16" = share the target's LM head; else an MX format for a draft copy

    def __post_init__(self) -> None:
        if self.fmt not in DRAFT_FORMATS:
            raise ValueError(f"unknown draft format {self.fmt!r} (choose from {', '.join(DRAFT_FORMATS)})")
        if self.lm_head != "bf16" and self.lm_head not in DRAFT_FORMATS:
            raise ValueError(f"unknown draft LM head format {self.lm_head!r} "
                             f"(bf16 or one of {', '.join(DRAFT_FORMATS)})")


CAST_ROWS = 4096  # rows cast at a time: the fp32 working copy of an LM head would be ~100 MB


def pack_mx_matrix(w, fmt: str):
    """BF16 [N, K] -> packed MX weights (the drafts' cast, cast_rule, then repacked for the kernels).

    The cast is row-wise (blocks run along K), so casting CAST_ROWS rows at a time gives the same
    codes while keeping the transient fp32 copy small: the draft adds only its packed weights
    to the peak memory, not a float copy of the largest matrix. `w`: a BF16 torch tensor
    (qspec.mx, which imports torch, is needed only here)."""
    from . import mx

    n, k = w.shape
    codes = scales = None
    for r0 in range(0, n, CAST_ROWS):
        t = mx.quantize(w[r0:r0 + CAST_ROWS], fmt, rule=cast_rule(fmt))
        if codes is None:
            codes = np.empty((n, t.codes.shape[1]), np.uint8)
            scales = np.empty((n, t.scales.shape[1]), np.uint8)
        codes[r0:r0 + CAST_ROWS] = t.codes.numpy()
        scales[r0:r0 + CAST_ROWS] = t.scales.numpy()
    return _C.pack_mx(fmt, codes, scales, k)


def checkpoint_identity(model_dir: Path) -> dict:
    """What a packed file was made from: the checkpoint's path, weight files (total bytes, and
    each file's size and mtime) and config.json hash. A draft file is checked on the bytes and
    the hash (it survives copying the model); the weight cache on all of it."""
    from .loader import _weight_files

    files = _weight_files(model_dir)
    index = model_dir / "model.safetensors.index.json"
    stats = {f.name: f.stat() for f in files + ([index] if index.exists() else [])}
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    return {"path": str(model_dir.resolve()), "weight_bytes": str(sum(stats[f.name].st_size for f in files)),
            "config_sha256": digest, "files": {n: [s.st_size, s.st_mtime_ns] for n, s in stats.items()}}


def _header_reserve(meta: Mapping[str, str], names: Sequence[str]) -> int:
    """Bytes before the data (8-byte length + header), page-rounded: an upper bound on the header
    of these matrices (<= 4 buffers each, 20-digit numbers, "matrices" escaped inside metadata)."""
    bound = 4096 + 2 * len(json.dumps(dict(meta))) + sum(6 * len(n) + 600 for n in names)
    return -(-bound // PAGE) * PAGE


def write_packed_file(path: Path, meta: Mapping[str, str], names: Sequence[str],
                      items: Iterable[tuple[str, object]]) -> Path:
    """Write packed weights as they come (`items`: (name, PackedWeight or float32 array), each
    one of `names`): buffers are streamed to a uniquely named temp file in the target directory
    (nothing is held back in memory), the header is written last into the space reserved for it,
    and the file is renamed into place: readers see the old file or the complete new one, never
    a partial one."""
    path = Path(path)
    names = list(names)
    reserve = _header_reserve(meta, names)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(reserve)
            header: dict = {}
            matrices: dict[str, list] = {}
            off = 0
            seen = set()
            for name, pw in items:
                if name not in names or name in seen or "/" in name:
                    raise ValueError(f"unexpected packed matrix {name!r}")
                seen.add(name)
                if isinstance(pw, np.ndarray):  # a small F32 tensor, stored as it is
                    arr = np.ascontiguousarray(pw, dtype=np.float32)
                    parts = [(name, "F32", list(arr.shape), arr)]
                else:
                    matrices[name] = [pw.fmt, pw.n, pw.k]
                    parts = [(f"{name}/{buf}", "U8", [a.nbytes], a) for buf, a in sorted(pw.buffers().items())]
                for key, dtype, shape, arr in parts:
                    f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
                    header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + arr.nbytes]}
                    off += arr.nbytes
            if seen != set(names):
                raise ValueError(f"packed matrices missing: {sorted(set(names) - seen)[:3]}")
            header["__metadata__"] = {**meta, "matrices": json.dumps(matrices)}
            raw = json.dumps(header, separators=(",", ":")).encode()
            if 8 + len(raw) > reserve:  # _header_reserve is an upper bound: a bug if hit
                raise AssertionError(f"packed file header ({len(raw)} bytes) exceeds its reserve {reserve}")
            f.seek(0)
            f.write(struct.pack("<Q", reserve - 8) + raw + b" " * (reserve - 8 - len(raw)))
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a cache directory may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise DraftFileError(f"{path}: not a qspec draft file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise DraftFileError(f"{path}: not a qspec draft file (bad header)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise DraftFileError(f"{path}: no such draft file") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DraftFileError(f"{path}: not a qspec draft file (bad header)") from None
    if not isinstance(header, dict):
        raise DraftFileError(f"{path}: not a qspec draft file (bad header)")
    return header, 8 + n


def read_packed_file(path: Path) -> tuple[dict, dict]:
    """Memory-maps a packed file: (its metadata, {matrix: PackedWeight, small tensor: float32
    array}); both borrow the mapping (no copy). DraftFileError when it is not one, of another
    version or layout, or corrupt (bad header, truncated, buffer sizes not those of the layout)."""
    path = Path(path)
    header, data_start = _read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or meta.get("qspec_draft_version") is None:
        raise DraftFileError(f"{path}: not a qspec draft file (no qspec metadata)")
    if meta["qspec_draft_version"] != str(DRAFT_FILE_VERSION) or \
            meta.get("pack_layout_version") != str(_C.PACK_LAYOUT_VERSION):
        raise DraftFileError(f"{path}: written by another qspec version (draft v{meta['qspec_draft_version']}, "
                             f"layout v{meta.get('pack_layout_version')}; this build reads v{DRAFT_FILE_VERSION}, "
                             f"layout v{_C.PACK_LAYOUT_VERSION}); re-run `qspec quantize`")
    try:
        matrices = json.loads(meta["matrices"])
        if not isinstance(matrices, dict):
            raise ValueError("matrices is not a mapping")
    except (KeyError, TypeError, ValueError) as e:
        raise DraftFileError(f"{path}: invalid draft metadata ({e})") from None
    size = path.stat().st_size
    buffers: dict[str, dict[str, tuple[int, int]]] = {name: {} for name in matrices}
    smalls: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    end = 0
    for key, info in header.items():
        name, _, buf = key.rpartition("/")
        try:
            lo, hi = info["data_offsets"]
            ok = 0 <= lo <= hi <= size - data_start
            if info["dtype"] == "F32" and not name:  # a small tensor
                shape = tuple(int(d) for d in info["shape"])
                ok = ok and lo % 4 == 0 and hi - lo == 4 * int(np.prod(shape))
                smalls[key] = (lo, hi, shape)
            else:
                ok = ok and name in buffers and info["dtype"] == "U8"
                buffers[name][buf] = (lo, hi)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DraftFileError(f"{path}: corrupt draft file (tensor {key})")
        end = max(end, hi)
    if end != size - data_start:
        raise DraftFileError(f"{path}: corrupt draft file ({size} bytes, its header says {data_start + end})")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.empty(0, np.uint8)
    packed: dict = {key: mm[data_start + lo: data_start + hi].view(np.float32).reshape(shape)
                    for key, (lo, hi, shape) in smalls.items()}
    for name, spec in matrices.items():
        try:
            fmt, n, k = spec
            views = {buf: mm[data_start + lo: data_start + hi] for buf, (lo, hi) in buffers[name].items()}
            packed[name] = _C.PackedWeight.from_buffers(fmt, n, k, views)
        except (ValueError, TypeError) as e:
            raise DraftFileError(f"{path}: corrupt draft file ({name}: {e})") from None
    return meta, packed


def packed_file_meta(kind: str, fmt: str, lm_head: str, identity: dict, **extra: str) -> dict[str, str]:
    """A packed file's metadata; a draft's records its cast (DRAFT_CAST)."""
    return {"qspec_draft_version": str(DRAFT_FILE_VERSION), "pack_layout_version": str(_C.PACK_LAYOUT_VERSION),
            "kind": kind, "format": fmt, "lm_head": lm_head, "source": json.dumps(identity),
            **({"cast": DRAFT_CAST} if kind == "draft" else {}), **extra}


def save_draft_file(path: Path, model_dir: Path, spec: DraftSpec,
                    packed: Mapping[str, object] | Iterable[tuple[str, object]],
                    names: Sequence[str] | None = None) -> Path:
    """Write a draft file: `packed` is {matrix: PackedWeight}, or (matrix, PackedWeight) pairs
    produced one at a time (then `names` lists them) so that casting never holds the whole draft."""
    if isinstance(packed, Mapping):
        names, packed = list(packed), packed.items()
    meta = packed_file_meta("draft", spec.fmt, spec.lm_head, checkpoint_identity(model_dir))
    return write_packed_file(path, meta, names, packed)


def load_draft_file(path: Path, model_dir: Path) -> tuple[DraftSpec, dict]:
    """Memory-maps a draft file; the packed weights borrow the mapping (no copy)."""
    path = Path(path)
    meta, packed = read_packed_file(path)
    if meta.get("kind", "draft") != "draft":
        raise DraftFileError(f"{path}: a qspec weight cache file, not a draft file")
    try:
        src = json.loads(meta.get("source", "{}"))
        spec = DraftSpec(meta["format"], meta.get("lm_head", "bf16"))
    except (KeyError, TypeError, ValueError) as e:
        raise DraftFileError(f"{path}: invalid draft metadata ({e})") from None
    src = src if isinstance(src, dict) else {}
    mine = checkpoint_identity(model_dir)
    if (src.get("weight_bytes"), src.get("config_sha256")) != (mine["weight_bytes"], mine["config_sha256"]):
        raise DraftFileError(f"{path}: made from another checkpoint ({src.get('path')}), not {model_dir}")
    return spec, packed
