"""Start-up: with the packed weights in the weight cache (or a draft file), loading and generating
never import torch (~2 s of import on its own); the first load, which packs, still works."""

import json
import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str, cache_dir, **fmt) -> dict:
    """Run `code` in a fresh interpreter with QSPEC_CACHE=cache_dir; the JSON it prints last."""
    env = dict(os.environ, QSPEC_CACHE=str(cache_dir))
    env.pop("QSPEC_NO_WEIGHT_CACHE", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code).format(**fmt)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm(default_model_dir, tmp_path_factory):
    """A weight cache filled by a first (cold) load, and a draft file written from it."""
    root = tmp_path_factory.mktemp("startup")
    out = run_python("""
        import json, sys
        import qspec
        from qspec.draft import save_draft_file
        e = qspec.load({model!r})
        r = e.generate("Hi!", max_new_tokens=4)
        save_draft_file({draft_file!r}, e.model_dir, e.draft, e.backend.draft_packed)
        print(json.dumps(dict(info=e.backend.load_info, tokens=r.tokens)))
    """, root / "cache", model=str(default_model_dir), draft_file=str(root / "draft.safetensors"))
    assert out["info"]["target"] == "built+cached" and out["info"]["draft"] == "built+cached"
    assert len(out["tokens"]) == 4
    return root, out["tokens"]


def test_warm_load_and_generate_never_import_torch(default_model_dir, warm):
    root, cold_tokens = warm
    out = run_python("""
        import json, sys
        import qspec
        e = qspec.load({model!r})
        info = e.backend.load_info
        sampled = dict(max_new_tokens=4, temperature=0.8, top_k=40, top_p=0.9, seed=3)
        r = dict(spec=e.generate("Hi!", max_new_tokens=4).tokens,
                 plain=e.generate("Hi!", max_new_tokens=4, speculative=False).tokens,
                 spec_auto=e.generate("Hello there", max_new_tokens=4, draft_max="auto").tokens,
                 sampled=e.generate("Hi!", **sampled).tokens,
                 sampled_again=e.generate("Hi!", **sampled).tokens,
                 sampled_plain=e.generate("Hi!", speculative=False, **sampled).tokens,
                 streamed="".join(e.stream("Hi!", max_new_tokens=4, temperature=0.5, seed=1)))
        nd = qspec.load({model!r}, draft=None)
        r["no_draft"] = nd.generate("Hi!", max_new_tokens=4).tokens
        r["no_draft_sampled"] = nd.generate("Hi!", **sampled).tokens
        f = qspec.load({model!r}, draft_file={draft_file!r})
        r["draft_file"] = f.generate("Hi!", max_new_tokens=4).tokens
        print(json.dumps(dict(info=info, torch="torch" in sys.modules, **r)))
    """, root / "cache", model=str(default_model_dir), draft_file=str(root / "draft.safetensors"))
    assert out["info"]["target"] == "cache" and out["info"]["draft"] == "cache", out["info"]
    assert out["torch"] is False
    assert out["spec"] == out["plain"] == out["no_draft"] == out["draft_file"] == cold_tokens
    assert out["sampled"] == out["sampled_again"] and len(out["sampled_plain"]) == 4
    assert out["streamed"]


@pytest.mark.parametrize("argv,ok", [
    (["info"], True),
    (["--help"], True),
    (["fetch", "--list"], True),
    (["generate", "-n", "2", "--temp", "-1", "Hi"], False),    # an argument error
    (["generate", "-m", "/nonexistent/model", "Hi"], False),  # a load error
    (["generate", "-m", "{model}", "-n", "3", "Hi!"], True),  # the warm path
])
def test_cli_never_imports_torch(default_model_dir, warm, argv, ok):
    root, _ = warm
    out = run_python("""
        import contextlib, io, json, sys
        from qspec.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                rc = main({argv!r})
            except SystemExit as e:  # --help
                rc = e.code
        print(json.dumps(dict(rc=rc, torch="torch" in sys.modules, server="fastapi" in sys.modules)))
    """, root / "cache", argv=[a.format(model=default_model_dir) for a in argv])
    assert out["torch"] is False
    assert out["server"] is False  # only `qspec serve` imports the server's libraries
    assert (out["rc"] == 0) == ok, out


def test_bench_so_replaces_the_extension_everywhere(tmp_path):
    """QSPEC_BENCH_SO (A/B runs of two builds): every module that uses qspec._C, the CLI's bench
    modules included, gets that file, not the installed one (it used to be swapped in after the
    package had loaded its own, so both "builds" of an A/B ran the installed one)."""
    import shutil

    from qspec import _C
    copy = tmp_path / "other" / os.path.basename(_C.__file__)
    copy.parent.mkdir()
    shutil.copy(_C.__file__, copy)
    code = textwrap.dedent("""
        import json
        import qspec.cli, qspec.bench.common as common, qspec.native as native
        import qspec
        print(json.dumps([qspec._C.__file__, common._C.__file__, native._C.__file__]))
    """)
    for so, expect in ((None, _C.__file__), (str(copy), str(copy))):
        env = dict(os.environ, QSPEC_CACHE=str(tmp_path / "cache"))
        env.pop("QSPEC_BENCH_SO", None)
        if so:
            env["QSPEC_BENCH_SO"] = so
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == [expect] * 3
