"""Rank processes forked from a server that imported torch and safepoint once.

A test's rank process spends about 2.5 CPU-seconds importing torch, torch.distributed and
safepoint before it does anything, and `make test` starts hundreds of them on 2 cores. Forked
from a multiprocessing forkserver that imported them already (one per pytest worker), a rank
starts in milliseconds and runs its script as `python SCRIPT ARGS...` would: as __main__, with
the script's directory first on sys.path, the caller's environment and working directory, its
output in files, its exit status from SystemExit, an exception or os._exit, and the atexit
handlers run at the end. What differs: modules the script imports were imported before the
caller's environment was set, so a caller whose environment changes how torch imports (TORCH_*,
OMP_*, MKL_*, CUDA*) gets plain processes instead, as does every caller under
$SAFEPOINT_TEST_ZYGOTE=0."""

from __future__ import annotations

import multiprocessing
import os
import sys

PRELOAD = ["torch", "torch.distributed", "safepoint"]
IMPORT_TIME_ENV = ("TORCH_", "OMP_", "MKL_", "CUDA", "PYTORCH_")

_context = None
_base_env: dict = {}  # the environment the server started with (this process's, at first use)


def usable(env: dict) -> bool:
    """Whether a process with environment `env` may be forked from the server: not under
    $SAFEPOINT_TEST_ZYGOTE=0, and only where `env` sets no import-time variable otherwise than
    the server's environment."""
    if env.get("SAFEPOINT_TEST_ZYGOTE", "1") == "0":
        return False
    base = _base_env or os.environ
    keys = {k for k in (*env, *base) if k.startswith(IMPORT_TIME_ENV)}
    return all(env.get(k) == base.get(k) for k in keys)


def context():
    global _context, _base_env
    if _context is None:
        _base_env = dict(os.environ)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _main(script: str, args: list, env: dict, cwd: str, out: str, err: str) -> None:
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        for path, fd in ((out, 1), (err, 2)):
            f = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass
        os._exit(code)


def start(argv: list, out: str, err: str, env: dict | None = None):
    """Starts `python argv...` forked from the server; returns the multiprocessing Process
    (`.join(timeout)`, `.exitcode`, `.kill()`)."""
    p = context().Process(target=_main, args=(str(argv[0]), [str(a) for a in argv[1:]],
                                              dict(os.environ if env is None else env),
                                              os.getcwd(), out, err))
    p.start()
    return p
