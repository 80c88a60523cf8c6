"""The read-after-step rule: whatever reads the parameters after `step()`
returns sees the finished step, never weights the daemon is still writing.

Found with the Hugging Face Trainer: `model.safetensors` saved at step 40
differed from the final weights in 20 of 57 tensors, because with `model=`
(per-layer waits) `step()` returned before dosd had written the new weights
and only the next forward waited. Here on the CPU path (shared memory) with a
model large enough (~1M parameters in 64 subgroups) that the daemon is still
writing when step() returns: every reader must see exactly the weights that
a fully waited step leaves, under every scheduling policy (on a dosd without
a GPU they all run on the CPU path), with and without `model=`.
"""

import io

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402

POLICIES = ["cpu", "static:0.5", "interleave:2", "auto"]
SUBGROUP = 16384
STEPS = 4


def make_model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(512, 4))
    return torch.nn.Sequential(*layers)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(32, 512, generator=g), torch.randn(32, 4, generator=g)


def backward(model, opt, i):
    x, y = batch(i)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def finished(opt, model):
    """The weights once the step is collected (last_step waits for it)."""
    assert opt.last_step is not None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal_state(got, want, what):
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ from the finished step " \
                    f"({', '.join(bad[:4])})"


def make_opt(model, socket, policy, with_model, **kw):
    opt = dos.torch.AdamW(model.parameters(), socket=socket, lr=1e-3, weight_decay=0.01,
                          subgroup_size=SUBGROUP, client_name=f"read-after-step-{policy}",
                          **(dict(model=model) if with_model else {}), **kw)
    opt.set_policy(policy)
    return opt


@pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_torch_save_state_dict_right_after_step(dos_socket, policy, with_model):
    """The README's loop and a plain `torch.save(model.state_dict())` right
    after `step()`: the file holds the finished step."""
    model = make_model()
    with make_opt(model, dos_socket, policy, with_model) as opt:
        for i in range(STEPS):
            backward(model, opt, i)
            opt.step()
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            buf.seek(0)
            saved = torch.load(buf)
            assert_equal_state(saved, finished(opt, model), f"step {i + 1}, torch.save")


@pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model"])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_unhooked_reads_right_after_step(dos_socket, policy, with_model):
    """Reads that pass through no module hook (a tensor held since before the
    step, `parameters()`, torch.save of the parameter list): on the CPU path
    step() returns after the update by default, so they see it too."""
    model = make_model()
    held = list(model.parameters())
    with make_opt(model, dos_socket, policy, with_model) as opt:
        for i in range(STEPS):
            backward(model, opt, i)
            opt.step()
            direct = {str(j): p.detach().cpu().clone() for j, p in enumerate(held)}
            buf = io.BytesIO()
            torch.save(list(model.parameters()), buf)
            buf.seek(0)
            listed = {str(j): t.detach() for j, t in enumerate(torch.load(buf))}
            final = {str(j): t for j, t in enumerate(finished(opt, model).values())}
            assert_equal_state(direct, final, f"step {i + 1}, p.detach().cpu()")
            assert_equal_state(listed, final, f"step {i + 1}, torch.save(parameters)")


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_overlapping_steps_guard_hooked_reads(dos_socket, policy):
    """async_step=True on the CPU path (opt-in: step() returns with the step in
    flight, the next forward waits per layer): module state_dict() at every
    level, evaluation through the model, and opt.synchronize() see the
    finished step."""
    model = make_model()
    with make_opt(model, dos_socket, policy, True, async_step=True) as opt:
        for i in range(STEPS):
            backward(model, opt, i)
            opt.step()
            assert opt._inflight, "async_step=True must leave the step in flight"
            if i % 4 == 0:
                got = {k: v.clone() for k, v in model.state_dict().items()}
            elif i % 4 == 1:  # a submodule alone
                got = {f"8.{k}": v.clone() for k, v in model[8].state_dict().items()}
            elif i % 4 == 2:  # evaluation under no_grad through the model's hooks
                with torch.no_grad():
                    out = model(batch(0)[0])
                opt.synchronize()
                with torch.no_grad():
                    want = model(batch(0)[0])
                assert torch.equal(out, want), f"step {i + 1}: evaluation saw unfinished weights"
                got = None
            else:
                opt.synchronize()
                assert not opt._inflight
                got = {k: v.detach().clone() for k, v in model.state_dict().items()}
            final = finished(opt, model)
            if got is not None:
                assert_equal_state(got, {k: final[k] for k in got}, f"step {i + 1}")


def test_data_parallel_forward_sees_the_finished_step(dos_socket):
    """torch.nn.DataParallel copies every parameter to its replicas before
    any layer's pre-hook runs (the Hugging Face Trainer wraps the model in it
    on its own when a process sees several GPUs): the step in flight is
    finished before a DataParallel forward starts."""
    if torch.cuda.is_available():
        # DataParallel requires its module on the first visible GPU there.
        need_cuda()
        model = make_wide_cuda()
        opt_cm = make_cuda_opt(model, dos_socket, "auto", True)
        x = torch.randn(16, 1024, device="cuda")
        y = torch.randn(16, 8, device="cuda")

        def backward_(_model, opt, _i):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
    else:
        model = make_model()
        opt_cm = make_opt(model, dos_socket, "cpu", True, async_step=True)
        x = batch(0)[0]
        backward_ = backward
    wrapped = torch.nn.DataParallel(model)
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append(opt._inflight))
    with opt_cm as opt:
        for i in range(3):
            backward_(model, opt, i)
            opt.step()
            assert opt._inflight, "the step must be left in flight (async)"
            seen.clear()
            with torch.no_grad():
                out = wrapped(x)
            assert seen and not any(seen), "a DataParallel forward began with a step in flight"
            opt.synchronize()
            with torch.no_grad():
                assert torch.equal(out, model(x)), f"step {i + 1}"


def test_synchronize_without_a_step_is_a_no_op(dos_socket):
    model = make_model()
    with make_opt(model, dos_socket, "cpu", True) as opt:
        opt.synchronize()
        backward(model, opt, 0)
        opt.step()
        opt.synchronize()
        opt.synchronize()
        assert opt.last_step["step"] == 1


# ---- GPU mode (skipped without CUDA): step() returns at once there ----

def need_cuda():
    from dos import _native
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible: GPU-mode read-after-step tests skipped")
    if not _native.cuda_supported():
        pytest.skip("libdos_client was built without CUDA")


def make_cuda_opt(model, socket, policy, with_model):
    try:
        opt = dos.torch.AdamW(model.parameters(), socket=socket, lr=1e-3, weight_decay=0.01,
                              subgroup_size=65536, client_name=f"cuda-read-after-step-{policy}",
                              **(dict(model=model) if with_model else {}))
    except dos.DosError as e:
        if "no GPU engine" in e.message:
            pytest.skip(f"dosd has no GPU engine: {e.message}")
        raise
    opt.set_policy(policy)
    return opt


def make_wide_cuda():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(1024, 8))
    return torch.nn.Sequential(*layers).cuda()  # 4.2M parameters, 65 subgroups


@pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model"])
@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_cuda_reads_right_after_step(dos_socket, policy, with_model):
    """CUDA: step() returns while dosd is still writing. torch.save of the
    model's state_dict, a read after torch.cuda.synchronize(), and a read
    after opt.synchronize() all see the finished step; without model= every
    read queued on the current stream does too (it waits for the whole step)."""
    need_cuda()
    model = make_wide_cuda()
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(64, 1024, generator=g).cuda(), torch.randn(64, 8, generator=g).cuda())
            for _ in range(8)]
    opt = make_cuda_opt(model, dos_socket, policy, with_model)
    try:
        if not opt._parts.driver.mode.stream:
            pytest.skip("the CUDA driver has no stream memory operations")
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert opt._inflight
            reader = i % (3 if with_model else 4)
            if reader == 0:
                buf = io.BytesIO()
                torch.save(model.state_dict(), buf)
                buf.seek(0)
                got = torch.load(buf, map_location="cpu")
            else:
                if reader == 1:
                    torch.cuda.synchronize()
                elif reader == 2:
                    opt.synchronize()
                # reader 3 (no model=): a plain read queued on the current stream
                got = {k: p.detach().cpu() for k, p in model.named_parameters()}
            final = {k: v.cpu() for k, v in finished(opt, model).items()}
            assert_equal_state(got, {k: final[k] for k in got}, f"step {i + 1}, reader {reader}")
    finally:
        opt.close()
