"""Gradients autograd makes anew (p.grad was None: a model's zero_grad(), as
the Hugging Face Trainer calls it) go into the registered buffer as backward
finishes each (dos/_grads.py: take, install_take_hooks), so backward never
holds a second copy of the gradients. torch < 2.1 has no post-accumulate-grad
hooks: step() copies them there, and only `take` itself is tested."""

import types

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from dos import _grads  # noqa: E402

HAS_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def entry(param, copy_grad=False):
    """The fields of a registered entry that `take` reads."""
    grad = torch.zeros_like(param)
    return types.SimpleNamespace(param=param, grad_shm=grad, grad_home=grad.detach(),
                                 copy_grad=copy_grad, name="w")


def test_take_moves_a_new_gradient_into_the_registered_buffer():
    p = torch.nn.Parameter(torch.randn(5, 3))
    e = entry(p)
    fresh = torch.randn(5, 3)
    p.grad = fresh
    assert _grads.take(e)
    assert p.grad is e.grad_shm
    assert torch.equal(e.grad_shm, fresh)


def test_take_leaves_what_it_must_not_move():
    p = torch.nn.Parameter(torch.randn(4))
    e = entry(p)
    assert _grads.take(e) and p.grad is None  # no gradient: nothing to take
    p.grad = e.grad_shm
    assert _grads.take(e) and p.grad is e.grad_shm  # already in place
    # Another dtype (torch refuses to assign one; a stand-in parameter holds
    # it): left for step(), which names it.
    wrong = torch.randn(4, dtype=torch.float64)
    odd = types.SimpleNamespace(param=types.SimpleNamespace(grad=wrong, dtype=p.dtype),
                                grad_shm=e.grad_shm, grad_home=e.grad_home, copy_grad=False,
                                name="w")
    assert not _grads.take(odd)
    assert odd.param.grad is wrong and torch.count_nonzero(e.grad_shm) == 0
    assert "gradients must have the parameter's dtype and shape" in _grads.unusable(odd, wrong)
    sparse = torch.randn(4).to_sparse()  # a sparse one too: copy_ would fail in backward
    odd.param.grad = sparse
    assert not _grads.take(odd) and odd.param.grad is sparse
    assert _grads.unusable(odd, sparse) == "w " + _grads.SPARSE
    d = entry(p, copy_grad=True)  # an FSDP2 shard's gradient is FSDP's
    p.grad = torch.randn(4)
    assert _grads.take(d) and p.grad is not d.grad_shm


@pytest.mark.skipif(not HAS_HOOK, reason="needs torch >= 2.1 (post-accumulate-grad hooks)")
def test_model_zero_grad_gradients_land_in_the_registered_buffer(dos_socket):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, socket=dos_socket,
                          model=model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    entries = opt._parts.reg.entries
    try:
        for step in range(3):
            x = torch.randn(8, 16)
            model.zero_grad(set_to_none=True)  # what the Trainer does: p.grad = None
            model(x).square().mean().backward()
            for e in entries:  # before step(): already in dosd's buffer
                assert e.param.grad.data_ptr() == e.grad_shm.data_ptr(), (step, e.name)
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref(x).square().mean().backward()
            ref_opt.step()
        opt.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


@pytest.mark.parametrize("overlap", [False, True, "update"])
@pytest.mark.parametrize("grad", ["none", "registered"])
def test_a_sparse_gradient_is_refused_at_step_naming_it(dos_socket, grad, overlap):
    # An embedding with sparse gradients, refused as torch's AdamW refuses
    # it. Its gradient None: autograd makes a sparse one; the registered
    # buffer (after a step, or zero_grad(set_to_none=False)): autograd adds
    # the sparse one into it, where it would pass for a dense one (it once
    # trained on that). overlap: the early step begun during backward gives
    # it up ("update": applies nothing of it).
    if overlap and not HOOKS:
        pytest.skip("overlap needs torch >= 2.1")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4, sparse=True),
                                 "lin": torch.nn.Linear(4, 4)})
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, overlap=overlap)

    def loss():
        return model["lin"](model["emb"](torch.tensor([1, 2]))).sum()
    try:
        model.zero_grad(set_to_none=grad == "none")
        before = model["emb"].weight.detach().clone()
        loss().backward()
        with pytest.raises(dos.DosError) as e:
            opt.step()
        assert e.value.code_name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
        assert "has a sparse gradient" in e.value.message and "sparse=False" in e.value.message
        opt.synchronize()
        assert torch.equal(model["emb"].weight.detach(), before)
        # Dense again, training goes on.
        model["emb"].sparse = False
        opt.zero_grad()
        loss().backward()
        opt.step()
        opt.synchronize()
        assert not torch.equal(model["emb"].weight.detach(), before)
    finally:
        opt.close()
