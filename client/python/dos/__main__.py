"""`python -m dos [--socket PATH] [--timeout SECONDS]`: what this trainer
environment would use, and what is wrong with it.

Prints the package's version, the libdos_client it loads (path, where it was
found, its release and protocol) and the dosd it reaches (socket, pid,
release, protocol, health, sessions). Exits 0 when a trainer could attach,
1 when something is wrong, with one line per problem saying what to do:
no library, no daemon or a stale socket, versions that cannot work together
(the protocol numbers differ) or that differ in release only (a warning).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

from dos._version import __version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="dosd's socket (default: $DOS_SOCKET, else /run/dos/dosd.sock)")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for dosd")
    args = ap.parse_args(argv)
    problems, warnings = [], []
    print(f"dos-optimizer {__version__} (Python {sys.version.split()[0]}, {os.path.dirname(os.path.abspath(__file__))})")

    found = _library(problems)
    if found is None:
        return _finish(problems, warnings)
    _daemon(found, args.socket, args.timeout, problems, warnings)
    return _finish(problems, warnings)


def _library(problems):
    """(the binding, where the library was found), or None (a problem)."""
    from dos import _lib
    lib, source, tried = _lib._find()
    if lib is None:
        print("library:  NOT FOUND")
        for t in tried:
            print(f"          tried {t}")
        problems.append("libdos_client.so cannot be loaded: install the dos Debian package "
                        "(it ships libdos_client.so.1), or set DOS_CLIENT_LIB to a built "
                        "libdos_client.so")
        return None
    try:
        from dos import _native
    except (ImportError, AttributeError, OSError) as e:
        print(f"library:  {_lib.loaded_path(lib)} ({source}): unusable: {e}")
        problems.append(f"the library found is not one this package can use ({e}): install "
                        f"libdos_client {__version__} or point DOS_CLIENT_LIB at it")
        return None
    return _native, source


def _daemon(found, socket, timeout, problems, warnings) -> None:
    """Probes dosd at `socket` and says what the pair of versions means."""
    from dos import _lib
    _native, source = found
    info = _native.DaemonInfo()
    socket = socket or _native.default_socket()
    st = _native.lib.dos_daemon_probe(socket.encode(), int(timeout * 1000),
                                      ctypes.byref(info))
    client_version = (info.client_version or b"").decode()
    print(f"library:  {_lib.loaded_path(_native.lib)} ({source}), release {client_version}, "
          f"protocol {info.client_protocol_version}, CUDA {'yes' if _native.cuda_supported() else 'no'}")
    if client_version != __version__:
        warnings.append(f"this package is {__version__} but libdos_client is {client_version}: "
                        "install the pair of one release")
    if st != 0:
        msg = (_native.lib.dos_last_error() or b"").decode("utf-8", "replace")
        print(f"daemon:   {socket}: NOT REACHED")
        problems.append(msg)
        return
    version = (info.version or b"").decode()
    health = (info.health or b"").decode()
    print(f"daemon:   {socket}: dosd {version}, pid {info.pid}, protocol "
          f"{info.protocol_version or '?'}, {health}, {info.sessions} session(s)")
    if info.protocol_version != info.client_protocol_version:
        older = info.protocol_version < info.client_protocol_version
        problems.append(
            f"dosd {version} speaks protocol {info.protocol_version or '(older than 3)'}, this "
            f"library {info.client_protocol_version}: attaching will fail. " +
            (f"Upgrade dosd to {client_version} (the dos package), then systemctl restart dosd"
             if older else
             f"Install the client of dosd's release: pip install dos-optimizer=={version} and "
             "its libdos_client"))
    elif version != client_version:
        warnings.append(f"dosd is {version}, libdos_client {client_version}: they work together "
                        "(same protocol); upgrade both to one release when convenient")
    if health != "SERVING":
        problems.append(f"dosd reports {health}: it is shutting down or unwell; see its log "
                        "(journalctl -u dosd)")


def _finish(problems, warnings) -> int:
    for w in warnings:
        print(f"warning:  {w}")
    for p in problems:
        print(f"PROBLEM:  {p}")
    if not problems:
        print("ok:       a trainer here can attach")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
