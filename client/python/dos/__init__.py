"""DOS (Deep Optimizer States) client.

`dos.torch.AdamW` / `dos.torch.Adam` are drop-in torch optimizers whose fp32
state lives in the node's dosd daemon. `DosError` is raised by every failed
call; its `code` is the gRPC canonical code (`code_name` spells it).
"""

from dos._errors import DosError
from dos._native import default_socket

__all__ = ["DosError", "default_socket"]
__version__ = "0.1.0"
