"""Built PrimFuncs kept on disk, in TVM's JSON form of the IR, next to TileLang's kernel cache.

TileLang finds a compiled kernel in its cache by the PrimFunc's script, so even a warm start
first builds every PrimFunc: our kernels' Python builders take ~1.6 s for the 15 kernels of a
Qwen3-Next layer's fwd+bwd (2-core CPU machine), reading their saved IR back 0.025 s, and the
IR read back prints the same script, so it finds the same cache entry. The entries are read by
TVM's JSON reader itself (`node.LoadJSON`): `tvm.ir.load_json` first re-encodes the whole text
through Python's json module to upgrade an older TVM's format (0.16 s for those 15, same
machine), which an entry written by this TileLang version never needs. An entry is named by the
spec, TileLang's version and a hash of the builders' sources (`kernels/hopper/`, `constants.py`):
a changed builder never reads an old PrimFunc.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile

from .hopper.common import import_tilelang

STORE_DIR_NAME = "flash_qla_cp_prim_funcs"  # inside TileLang's cache directory
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCE_DIRS = (os.path.join(_PACKAGE, "kernels", "hopper"),)
_SOURCE_FILES = (os.path.join(_PACKAGE, "constants.py"),)


@functools.lru_cache(maxsize=1)
def builders_hash() -> str:
    """sha256 of the kernel builders' sources (read once per process)."""
    paths = sorted(os.path.join(d, f) for d in _SOURCE_DIRS for f in os.listdir(d) if f.endswith(".py"))
    digest = hashlib.sha256()
    for path in (*paths, *_SOURCE_FILES):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.hexdigest()


def entry_path(spec) -> str:
    """Where `spec`'s PrimFunc is kept."""
    tilelang, _ = import_tilelang()
    key = json.dumps([spec.factory.__module__, spec.factory.__qualname__, repr(spec.params),
                      tilelang.__version__, builders_hash()])
    name = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(tilelang.env.TILELANG_CACHE_DIR, STORE_DIR_NAME, name + ".json")


def prim_func(spec):
    """`spec`'s PrimFunc: read back where an earlier build saved it, else built and saved."""
    tilelang, _ = import_tilelang()
    ir = tilelang.tvm.ir
    path = entry_path(spec)
    try:
        with open(path) as f:
            func = tilelang.tvm.get_global_func("node.LoadJSON")(f.read())
    except Exception:  # noqa: BLE001 - none saved yet, or a damaged entry: built again below
        func = None
    if isinstance(func, ir.BaseFunc):
        return func
    func = spec.build()
    if isinstance(func, ir.BaseFunc):  # (not a test's stand-in)
        _save(path, ir.save_json(func))
    return func


def _save(path: str, text: str) -> None:
    """Written whole or not at all (a rank reading it while another writes sees the old state);
    a directory that cannot be written only costs the next start its builds."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
