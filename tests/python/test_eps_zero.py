"""eps = 0 is a valid Adam hyperparameter for torch, for the Python optimizer,
for the client library and, since issue 13, for dosd at registration and at
every step (it used to refuse every step after a successful registration).
Gradients here are never all zero in an element, so sqrt(v) > 0 and the
update stays finite; the weights follow torch.optim.AdamW's.
"""

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402


def test_eps_zero_steps_like_torch(dos_socket):
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    mine = torch.nn.Linear(8, 4)
    mine.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=0.0)
    opt = dos.torch.AdamW(mine.parameters(), lr=1e-3, eps=0.0, socket=dos_socket,
                          client_name="pytest-eps0")
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(20):
            x = torch.randn(16, 8, generator=g) + 0.5
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                model(x).square().sum().backward()
                o.step()
            for a, b in zip(mine.parameters(), ref.parameters()):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"step {step}"
    finally:
        opt.close()
