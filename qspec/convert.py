"""Import a GGUF file (llama.cpp) as a Hugging Face style directory of BF16 safetensors.

`qspec convert MODEL.gguf OUT_DIR` (qspec/cli.py) calls `convert_gguf`. The output is what qspec (and
transformers) load: config.json, model.safetensors (sharded above 4 GB), tokenizer.json,
tokenizer_config.json, generation_config.json.

Choices:
- Every tensor is dequantized by the gguf package (`gguf.quants.dequantize`) to float32 and
  rounded to BF16 (round-to-nearest-even, torch). Norm weights too: HF checkpoints such as
  SmolLM2 store them in BF16, one dtype per file keeps the loader simple, and the model loader
  upcasts norms to fp32 anyway.
- Architectures (qspec/gguf_arch.py): llama, qwen2, qwen3, smollm3, gemma3 (text), phi3.
  llama.cpp's converter interleaves the rows of q_proj / k_proj for `llama` and `smollm3` (RoPE
  on adjacent pairs instead of HF's halves); `unpermute_qk` undoes it. It stores Gemma's norm
  weights as 1 + w; the import subtracts the 1 again (in float32, before rounding to BF16).
- The tokenizer (qspec/gguf_tokenizer.py): byte-level BPE or SentencePiece, rebuilt as
  transformers' GGUF loader builds it.
- Writing is atomic: everything goes into a temp directory beside OUT_DIR, then one rename.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qspec.errors import ModelLoadError
from qspec.gguf_arch import ARCHS, arch_config, expected_shapes, field, gguf_name, hf_name, require
from qspec.gguf_tokenizer import build_tokenizer

SHARD_BYTES = 4 * 1024**3  # one safetensors file up to this size, then shards
BF16_BYTES = 2

def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave for one projection (weight [rows, K] or bias [rows]).

    llama.cpp (convert_hf_to_gguf.py, LlamaModel.permute) stores
        gguf = hf.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(hf.shape)
    i.e. within each head, HF row j * (head_dim/2) + i (j = half 0/1) becomes gguf row 2 * i + j.
    The inverse views gguf as [n_head, head_dim/2, 2, ...] and swaps the two middle axes back.
    n_head is the head count of that projection (num_key_value_heads for k_proj).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a Q/K tensor of {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class _Source:
    """A GGUF file opened for conversion: its reader, architecture and hyper-parameters."""

    path: Path
    reader: object  # gguf.GGUFReader
    arch: str
    hparams: dict


def _open_gguf(path: Path):
    # gguf imports lazily: importing it costs ~0.3 s and most qspec commands never need it.
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
        # Touch every tensor's metadata now, so a truncated file fails here, not mid-write.
        for t in reader.tensors:
            n_bytes = int(t.n_bytes)
            if t.data.nbytes != n_bytes:
                raise ValueError(f"tensor {t.name} is truncated")
    except ModelLoadError:
        raise
    except (ValueError, struct.error, IndexError, KeyError, TypeError, OverflowError, EOFError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{path.name} is not a valid GGUF file or is truncated ({msg})") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    return reader


def _read_source(path: Path) -> _Source:
    reader = _open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path.name}: GGUF metadata general.architecture is missing")
    if arch not in ARCHS:
        supported = ", ".join(sorted(ARCHS))
        raise ModelLoadError(f"unsupported GGUF architecture '{arch}' (supported: {supported})")

    a = arch
    n_embd = int(require(reader, f"{a}.embedding_length"))
    n_head = int(require(reader, f"{a}.attention.head_count"))
    n_head_kv = int(field(reader, f"{a}.attention.head_count_kv", n_head))
    head_dim = int(field(reader, f"{a}.attention.key_length", n_embd // n_head))
    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path.name}: tensor token_embd.weight is missing")
    vocab_size = int(field(reader, f"{a}.vocab_size", int(embd.shape[-1])))
    hparams = {
        "hidden_size": n_embd,
        "intermediate_size": int(require(reader, f"{a}.feed_forward_length")),
        "num_hidden_layers": int(require(reader, f"{a}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(field(reader, f"{a}.context_length", 2048)),
        "rms_norm_eps": float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    rope_scaling = _rope_scaling(reader, a, hparams)
    if rope_scaling is not None:
        hparams["rope_scaling"] = rope_scaling
    return _Source(path=path, reader=reader, arch=arch, hparams=hparams)


def _rope_scaling(reader, a: str, hp: dict) -> dict | None:
    """HF rope_scaling from the GGUF keys, or from llama.cpp's rope_freqs tensor (Llama 3.1+)."""
    kind = field(reader, f"{a}.rope.scaling.type")
    factor = field(reader, f"{a}.rope.scaling.factor")
    orig_ctx = field(reader, f"{a}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and orig_ctx:
            scaling["original_max_position_embeddings"] = int(orig_ctx)
        return scaling
    if kind not in (None, "none"):
        raise ModelLoadError(f"unsupported GGUF rope scaling type '{kind}'")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return _llama3_scaling_from_factors(_dequantize(freqs), hp["head_dim"], hp["rope_theta"])


def _llama3_rope_factors(head_dim, theta, factor, low, high, orig_ctx) -> np.ndarray:
    # Llama 3.1 frequency scaling (as HF's _compute_llama3_parameters), expressed the way
    # llama.cpp stores it: the divisor of each rotary frequency.
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig_ctx / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig_ctx / high, 1.0, np.where(wavelen > orig_ctx / low, factor, medium))


def _llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """GGUF keeps only the per-frequency factors; find the llama3 parameters that produce them."""
    factors = factors.astype(np.float64).reshape(-1)
    factor = float(np.round(factors.max(), 4))
    for orig_ctx in (8192, 4096, 2048, 16384, 32768):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                want = _llama3_rope_factors(head_dim, theta, factor, low, high, orig_ctx)
                if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig_ctx,
                    }
    raise ModelLoadError("GGUF rope_freqs tensor does not match any llama3 rope scaling parameters")


def _dequantize(tensor) -> np.ndarray:
    """float32 array in numpy (row-major) order: ggml's shape [ne0, ne1] is [cols, rows]."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = np.asarray(dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors come back as a view of the read-only mmap
            values = values.copy()
        return values.reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} cannot be dequantized"
        ) from None
    except (ValueError, IndexError, TypeError) as e:
        raise ModelLoadError(f"tensor {tensor.name} is corrupt ({e})") from None


def _plan_tensors(src: _Source) -> list[tuple[object, str]]:
    """(gguf tensor, HF name) for every tensor written, validated against the config."""
    hp = src.hparams
    expected = expected_shapes(src.arch, hp)
    all_shapes = dict(expected)
    plan = []
    for t in src.reader.tensors:
        name = hf_name(src.arch, t.name)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        if name.endswith(".bias"):
            weight_rows = all_shapes.get(name[: -len("bias")] + "weight", (None,))[0]
            want = (weight_rows,)
        elif name in expected:
            want = expected.pop(name)
        else:
            raise ModelLoadError(f"unexpected GGUF tensor {t.name}")
        if shape != want:
            raise ModelLoadError(f"tensor {t.name} has shape {list(shape)}, config implies {list(want)}")
        plan.append((t, name))
    if expected:
        missing = sorted(expected)[0]
        raise ModelLoadError(f"{src.path.name}: tensor {gguf_name(src.arch, missing)} (HF {missing}) is missing "
                             f"({len(expected)} missing)")
    if hp["num_hidden_layers"] and src.arch == "qwen2":
        has_bias = any(n.endswith("q_proj.bias") for _, n in plan)
        if not has_bias:
            raise ModelLoadError(f"{src.path.name}: qwen2 GGUF without attention biases")
    return plan


def _to_hf_tensor(src: _Source, tensor, name: str) -> torch.Tensor:
    values = _dequantize(tensor)
    arch, hp = ARCHS[src.arch], src.hparams
    if arch.permuted_qk and ".self_attn.q_proj." in name:
        values = unpermute_qk(values, hp["num_attention_heads"])
    elif arch.permuted_qk and ".self_attn.k_proj." in name:
        values = unpermute_qk(values, hp["num_key_value_heads"])
    elif arch.norm_shift and tensor.name.endswith("norm.weight"):  # llama.cpp stored 1 + w
        values -= np.float32(arch.norm_shift)
    # torch's float32 -> bfloat16 cast rounds to nearest even.
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)


def _shard_plan(plan):
    """Split the tensor list into consecutive groups of at most SHARD_BYTES of BF16."""
    shards, current, size = [], [], 0
    for item in plan:
        n = int(np.prod([int(x) for x in item[0].shape])) * BF16_BYTES
        if current and size + n > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        shards.append(current)
    return shards


def _write_weights(src: _Source, plan, out: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    shards = _shard_plan(plan)
    bar = tqdm(
        total=len(plan), unit="tensor", desc=f"convert {src.path.name}", file=sys.stderr,
        disable=not progress or not sys.stderr.isatty(), leave=False,
    )
    weight_map, total_size = {}, 0
    with bar:
        for i, shard in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else (
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
            tensors = {}
            for tensor, name in shard:
                tensors[name] = _to_hf_tensor(src, tensor, name)
                total_size += tensors[name].numel() * BF16_BYTES
                weight_map[name] = file
                bar.update(1)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            os.chmod(out / file, 0o644)  # safetensors creates it 0600; the cache may be shared
            del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer_and_configs(src: _Source, out: Path) -> None:
    reader, hp = src.reader, src.hparams
    ids = {
        k: (None if v is None else int(v)) for k, v in {
            "bos": field(reader, "tokenizer.ggml.bos_token_id"),
            "eos": field(reader, "tokenizer.ggml.eos_token_id"),
            "unk": field(reader, "tokenizer.ggml.unknown_token_id"),
            "pad": field(reader, "tokenizer.ggml.padding_token_id"),
        }.items()
    }
    tok, tokens, add_bos, add_eos = build_tokenizer(reader, src.arch, ids)
    for k, v in ids.items():
        if v is not None and not 0 <= v < len(tokens):
            raise ModelLoadError(f"GGUF tokenizer.ggml.{k}_token_id {v} is outside the vocabulary")
    tok.save(str(out / "tokenizer.json"))

    arch = ARCHS[src.arch]
    has_bias = any(t.name.endswith(".attn_q.bias") for t in reader.tensors)
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        **hp,
        **arch_config(reader, src.arch, hp, has_bias, lambda name: _tensor_values(reader, name)),
        "torch_dtype": "bfloat16",
        "qspec_source": {"file": src.path.name, "size": src.path.stat().st_size},
    }
    for k in ("bos", "eos", "pad"):
        if ids[k] is not None:
            config[f"{k}_token_id"] = ids[k]
    _write_json(out / "config.json", config)

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp["max_position_embeddings"],
    }
    for k in ("bos", "eos", "unk", "pad"):
        if ids[k] is not None:
            tok_config[f"{k}_token"] = tokens[ids[k]]
    template = field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tok_config)

    gen = {k + "_token_id": ids[k] for k in ("bos", "eos", "pad") if ids[k] is not None}
    _write_json(out / "generation_config.json", gen)


def _tensor_values(reader, name: str) -> np.ndarray | None:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else _dequantize(tensor)


def _is_nonempty_dir(p: Path) -> bool:
    return p.is_dir() and any(p.iterdir())


def convert_gguf(gguf_path, out_dir, *, progress: bool = True, overwrite: bool = False) -> Path:
    """Convert a GGUF file into an HF-style BF16 directory at out_dir; return out_dir.

    Raises ModelLoadError (one-line message) for a missing/corrupt/unsupported GGUF or an
    existing non-empty out_dir (unless overwrite=True, which replaces it). Never leaves a
    partial out_dir behind.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelLoadError(f"output path {out_dir} exists and is not a directory")
    if _is_nonempty_dir(out_dir) and not overwrite:
        raise ModelLoadError(f"output directory {out_dir} is not empty (use another path or overwrite)")
    src = _read_source(gguf_path)
    plan = _plan_tensors(src)

    parent = out_dir.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create {parent}: {e.strerror or e}") from None
    tmp = parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_tokenizer_and_configs(src, tmp)
        _write_weights(src, plan, tmp, progress)
        _move_into_place(tmp, out_dir, overwrite)
    except OSError as e:
        raise ModelLoadError(f"cannot write {out_dir}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out_dir


def _move_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    try:
        os.rename(tmp, out_dir)  # replaces an empty directory atomically on POSIX
        return
    except OSError:
        if not (overwrite and out_dir.is_dir()):
            if _is_nonempty_dir(out_dir):
                raise ModelLoadError(f"output directory {out_dir} is not empty") from None
            raise
    # overwrite: move the old directory aside, put the new one in place, then drop the old one.
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-"))
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)

