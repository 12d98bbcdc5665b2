"""Process-wide switches read from the environment at first use (csrc/cpu.h env_switch): each
value sets what a getter of qspec._C reports in a fresh process, and any other value is one CLI
line naming the choices, before anything is loaded."""

import os
import subprocess
import sys


def assert_env_switch(var: str, getter: str, on: str, off: str) -> None:
    code = f"from qspec import _C; print(_C.{getter}())"
    for value, want in ((on, "True"), (off, "False")):
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: value},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr
    r = subprocess.run([sys.executable, "-m", "qspec", "generate", "hi", "--max-new-tokens", "2"],
                       env={**os.environ, var: "amx2"}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"qspec: error: {var}='amx2' is not one of {on}, {off}"], r.stderr
