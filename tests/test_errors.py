"""Bad input through the Python API: a specific exception with a message naming the problem."""

import json
import shutil

import numpy as np
import pytest

import qspec
from qspec import DraftFileError, ModelLoadError, PromptTooLongError
from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, vocab_size=32, max_seq_len=40)
    return save_model_dir(tmp_path_factory.mktemp("tiny"), cfg, synthetic_weights(cfg))


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    return shutil.copytree(tiny, tmp_path / "m")


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        qspec.load(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        qspec.load(tmp_path)


def test_gguf_given_as_model(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="qspec convert"):
        qspec.load(f)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c.update(architectures=["MambaForCausalLM"]), "unsupported architecture"),
    (lambda c: c.pop("hidden_size"), "missing required key"),
    (lambda c: c.update(num_key_value_heads=3), "multiple"),
    (lambda c: c.update(hidden_size="wide"), "invalid value"),
])
def test_bad_config(tiny_copy, mutate, match):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    mutate(cfg)
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        qspec.load(tiny_copy)


def test_config_not_json(tiny_copy):
    (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        qspec.load(tiny_copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_corrupt_safetensors(tiny_copy, damage):
    f = tiny_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00" * 64,
                   "header": data[:8] + b"X" + data[9:]}[damage])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        qspec.load(tiny_copy)


def test_missing_tensor_and_wrong_shape(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing"):
        qspec.load(tiny_copy)
    cfg["num_hidden_layers"] = 2
    cfg["intermediate_size"] = 100
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        qspec.load(tiny_copy)


def test_generation_arguments(tiny):
    eng = qspec.load(tiny, draft="mxfp4")
    with pytest.raises(PromptTooLongError, match="context"):
        eng.generate([1] * 35, max_new_tokens=10)
    for kw, match in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-0.5), "temperature"),
                      (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(draft_max=0), "draft_max"),
                      (dict(draft_max=33), "draft_max"), (dict(draft_p_min=-0.1), "draft_p_min"),
                      (dict(draft_p_min=2.0), "draft_p_min"), (dict(draft_min=5, draft_max=2), "draft_min")]:
        with pytest.raises(ValueError, match=match):
            eng.generate([1, 2], **{"max_new_tokens": 4, **kw})
    with pytest.raises(ValueError, match="empty"):
        eng.generate("", max_new_tokens=4, chat=False)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([99], max_new_tokens=4)
    for bad in (None, 3, b"hi", [1.5, 2], [True], {"role": "user"}):
        with pytest.raises(TypeError, match="a prompt is text, a list of token ids"):
            eng.generate(bad, max_new_tokens=4)
    assert eng.generate(np.array([1, 2]), max_new_tokens=2).tokens == eng.generate([1, 2], max_new_tokens=2).tokens


def test_load_arguments(tiny):
    with pytest.raises(ValueError, match="draft format"):
        qspec.load(tiny, draft="mxfp3")
    with pytest.raises(ValueError, match="threads"):
        qspec.load(tiny, threads=0)


def test_draft_file_checks(tiny, tiny_copy, tmp_path):
    from qspec.draft import save_draft_file

    eng = qspec.load(tiny, draft="mxfp4")
    f = save_draft_file(tmp_path / "d.safetensors", tiny, eng.draft, eng.backend.draft_packed)
    assert qspec.load(tiny, draft_file=f).generate([1, 2], max_new_tokens=6).stats["drafted"] > 0
    # another checkpoint: same shapes, other config bytes
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftFileError, match="another checkpoint"):
        qspec.load(tiny_copy, draft_file=f)
    # another layout version
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(f), framework="numpy") as st:
        meta = dict(st.metadata())
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    meta["pack_layout_version"] = "0"
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=meta)
    with pytest.raises(DraftFileError, match="another qspec version"):
        qspec.load(tiny, draft_file=old)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(DraftFileError, match="corrupt"):
        qspec.load(tiny, draft_file=trunc)
    with pytest.raises(DraftFileError, match="no such"):
        qspec.load(tiny, draft_file=tmp_path / "missing.safetensors")
