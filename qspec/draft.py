"""The MX draft: the target's own weights cast to an MX format, and its `qspec quantize` file.

Only the GEMM weights are cast; embeddings, norms and (by default) the LM head are the target's
own, shared, not copied (DESIGN.md invariant 3: one weight source).

Draft file (safetensors, written atomically): one uint8 tensor per packed buffer, named
"<matrix>/<buffer>" where <matrix> is "layers.<i>.<wqkv|wo|w_gate_up|w_down>" or "lm_head".
Metadata: qspec_draft_version, pack_layout_version, format, lm_head, source (the checkpoint's
path, weight-file bytes and config.json SHA-256), and "matrices" = {matrix: [fmt, n, k]}.
A file of another version, layout, or checkpoint is refused with DraftFileError.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from . import _C, mx
from .errors import DraftFileError

DRAFT_FORMATS = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3")
DRAFT_FILE_VERSION = 1


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


def pack_mx_matrix(w: torch.Tensor, fmt: str):
    """BF16 [N, K] -> packed MX weights (direct cast per OCP MX v1.0, then repacked for the kernels).

    The cast is row-wise (blocks run along K), so casting CAST_ROWS rows at a time gives the same
    codes while keeping the transient fp32 copy small: the draft adds only its packed weights
    to the peak memory, not a float copy of the largest matrix."""
    n, k = w.shape
    codes = scales = None
    for r0 in range(0, n, CAST_ROWS):
        t = mx.quantize(w[r0:r0 + CAST_ROWS], fmt)
        if codes is None:
            codes = np.empty((n, t.codes.shape[1]), np.uint8)
            scales = np.empty((n, t.scales.shape[1]), np.uint8)
        codes[r0:r0 + CAST_ROWS] = t.codes.numpy()
        scales[r0:r0 + CAST_ROWS] = t.scales.numpy()
    return _C.pack_mx(fmt, codes, scales, k)


def checkpoint_identity(model_dir: Path) -> dict[str, str]:
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    return {"path": str(model_dir.resolve()), "weight_bytes": str(size), "config_sha256": digest}


def save_draft_file(path: Path, model_dir: Path, spec: DraftSpec, packed: dict) -> Path:
    tensors, matrices = {}, {}
    for name, pw in packed.items():
        matrices[name] = [pw.fmt, pw.n, pw.k]
        for buf, arr in pw.buffers().items():
            tensors[f"{name}/{buf}"] = np.ascontiguousarray(arr)
    meta = {"qspec_draft_version": str(DRAFT_FILE_VERSION), "pack_layout_version": str(_C.PACK_LAYOUT_VERSION),
            "format": spec.fmt, "lm_head": spec.lm_head, "source": json.dumps(checkpoint_identity(model_dir)),
            "matrices": json.dumps(matrices)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
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
    return header, 8 + n


def load_draft_file(path: Path, model_dir: Path) -> tuple[DraftSpec, dict]:
    """Memory-maps a draft file; the packed weights borrow the mapping (no copy)."""
    path = Path(path)
    header, data_start = _read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    if meta.get("qspec_draft_version") is None:
        raise DraftFileError(f"{path}: not a qspec draft file (no qspec metadata)")
    if meta["qspec_draft_version"] != str(DRAFT_FILE_VERSION) or \
            meta.get("pack_layout_version") != str(_C.PACK_LAYOUT_VERSION):
        raise DraftFileError(f"{path}: written by another qspec version (draft v{meta['qspec_draft_version']}, "
                             f"layout v{meta.get('pack_layout_version')}; this build reads v{DRAFT_FILE_VERSION}, "
                             f"layout v{_C.PACK_LAYOUT_VERSION}); re-run `qspec quantize`")
    src = json.loads(meta.get("source", "{}"))
    mine = checkpoint_identity(model_dir)
    if (src.get("weight_bytes"), src.get("config_sha256")) != (mine["weight_bytes"], mine["config_sha256"]):
        raise DraftFileError(f"{path}: made from another checkpoint ({src.get('path')}), not {model_dir}")
    try:
        spec = DraftSpec(meta["format"], meta.get("lm_head", "bf16"))
        matrices = json.loads(meta["matrices"])
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise DraftFileError(f"{path}: invalid draft metadata ({e})") from None
    size = path.stat().st_size
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buffers: dict[str, dict[str, np.ndarray]] = {name: {} for name in matrices}
    for key, info in header.items():
        name, _, buf = key.rpartition("/")
        lo, hi = info["data_offsets"]
        if name not in buffers or info.get("dtype") != "U8" or not 0 <= lo <= hi <= size - data_start:
            raise DraftFileError(f"{path}: corrupt draft file (tensor {key})")
        buffers[name][buf] = mm[data_start + lo: data_start + hi]
    packed = {}
    for name, (fmt, n, k) in matrices.items():
        try:
            packed[name] = _C.PackedWeight.from_buffers(fmt, n, k, buffers[name])
        except ValueError as e:
            raise DraftFileError(f"{path}: corrupt draft file ({name}: {e})") from None
    return spec, packed
