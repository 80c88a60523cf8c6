"""DOS (Deep Optimizer States) client.

`dos.torch.AdamW` / `dos.torch.Adam` are drop-in torch optimizers whose fp32
state lives in the node's dosd daemon. `DosError` is raised by every failed
call; its `code` is the gRPC canonical code (`code_name` spells it).
`python -m dos` says which library and daemon the package finds and what is
wrong, if anything.

`import dos` alone does not load libdos_client (so `python -m dos` can
report a missing one); the first use of `DosError`, `default_socket` or
`dos.torch` does.
"""

from dos._version import __version__

__all__ = ["DosError", "default_socket", "__version__"]


def __getattr__(name):
    if name == "DosError":
        from dos._errors import DosError
        return DosError
    if name == "default_socket":
        from dos._native import default_socket
        return default_socket
    raise AttributeError(f"module 'dos' has no attribute {name!r}")
