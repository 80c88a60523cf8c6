"""The delayed update (delay=1, dos/_delay.py) on the CPU path, where every
subgroup is on dosd's host path and so every one is delayed.

What it must be, step by step: torch's AdamW fed the gradients a one-step
delayed run computes (ZeRO-Offload's delayed parameter update): after step t
the model holds the weights of step t-1 and dosd's state is step t's; the
gradient of step t+1 is computed with the weights of step t-1. The reference
below runs torch.optim.AdamW on its own master weights and keeps the model
one step behind them; the weights are compared at every step within the
tolerance test_equivalence.py explains. Readers that must see whole steps
(state_dict(), the model's state_dict(), synchronize(), close()) install
the pending weights first; reports (last_step, found_inf) do not.
"""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from test_equivalence import assert_same, make_data, make_mlp  # noqa: E402

STEPS = 60


def reference(data, warmup, lr=1e-3, device="cpu", delayed_from=0, start=None, grad_mul=1.0,
              clip=None, opts=None):
    """The model's weights after each step of a delayed run (list index t:
    after step t) and the master weights after the last step. Elements from
    flat index `delayed_from` on (registration order) are delayed, the ones
    before it (resident on the GPU) applied at once. `start`: (the model's
    state_dict, torch AdamW's state_dict) to go on from, whole (a resume).
    `grad_mul`: the gradients are multiplied by it after backward, then
    clipped in place to norm `clip` (None: not). `opts`: a list that gets
    torch's AdamW."""
    model = make_mlp().to(device)
    master = make_mlp().to(device)
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    if start is not None:
        model.load_state_dict(start[0])
        master.load_state_dict(start[0])
        # A copy: torch's AdamW keeps the loaded step tensors and counts them
        # up in place (torch 2), which would change the caller's dict.
        opt.load_state_dict(copy.deepcopy(start[1]))
    masks, flat = [], 0
    for p in model.parameters():
        idx = torch.arange(flat, flat + p.numel(), device=device).view_as(p)
        masks.append(idx >= delayed_from)
        flat += p.numel()
    seen = [[p.detach().clone() for p in model.parameters()]]
    for t, (x, y) in enumerate(data, 1):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = q.grad.clone() * grad_mul if grad_mul != 1.0 else q.grad.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        before = [p.detach().clone() for p in master.parameters()]
        opt.step()
        # After a delayed step t the delayed elements hold step t-1's weights
        # (installed by step t), the others step t's.
        with torch.no_grad():
            for q, m, w, mask in zip(model.parameters(), master.parameters(), before, masks):
                q.copy_(torch.where(mask, w, m) if t > warmup else m)
        seen.append([p.detach().clone() for p in model.parameters()])
    if opts is not None:
        opts.append(opt)
    return seen, master


def check(model, weights, step):
    ref = make_mlp().to(weights[0].device)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), weights):
            p.copy_(w)
    assert_same(model, ref, step)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# (warm-up, subgroup size, CUDA policy): one subgroup or several (tensors
# crossing their bounds); on CUDA every subgroup on dosd's host path (policy
# cpu, nothing lent), or half of them resident on the GPU and updated at
# once beside the delayed ones (static:0.5).
CASES = [(0, 0, "cpu"), (5, 0, "cpu"), (3, 300, "cpu"), (3, 300, "static:0.5")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("warmup,subgroup_size,policy", CASES)
def test_delayed_steps_are_adamw_one_step_late(dos_socket, warmup, subgroup_size, policy,
                                               device):
    """The next forward waits per layer (model=); on CUDA the gradients go
    D2H and the weights H2D."""
    if device == "cpu" and policy != "cpu":
        pytest.skip("the CPU path has no resident tier")
    data = make_data(n=STEPS)
    # static:0.5 keeps lround(0.5 x 5) = 3 subgroups of 300 resident.
    delayed_from = 900 if policy == "static:0.5" else 0
    seen, master = reference(data, warmup, device=device, delayed_from=delayed_from)
    model = make_mlp().to(device)
    cuda = device == "cuda"
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, socket=dos_socket,
                          client_name="pytest-delay", model=model, delay=1,
                          delay_warmup=warmup, subgroup_size=subgroup_size,
                          **({"gpu_budget_bytes": 0} if cuda and policy == "cpu" else {}))
    if cuda:
        opt.set_policy(policy)
    try:
        for t, (x, y) in enumerate(data, 1):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            if cuda:
                # Direct reads pass no hook: the optimizer's stream orders them.
                torch.cuda.synchronize()
            last = opt.last_step  # a report: leaves the delayed update pending
            assert last["step"] == t
            assert (last["delayed_subgroups"] > 0) == (t > warmup), (t, last)
            check(model, seen[t], t)
        # A reader that must see a whole step installs step STEPS's weights.
        opt.synchronize()
        assert_same(model, master, STEPS)
    finally:
        opt.close()
    assert_same(model, master, STEPS)


HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def backward(opt, model, x, y, device, grad_mul=1.0):
    """zero_grad, forward and backward; the gradients then multiplied in
    place by `grad_mul` (as an unscale would) unless it is 1."""
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    if grad_mul != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(grad_mul)


@pytest.mark.skipif(not HOOKS, reason="overlap=True needs torch >= 2.1 "
                    "(register_post_accumulate_grad_hook)")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mul", [1.0, 0.5])
def test_an_early_delayed_step_copies_the_gradients_during_backward(dos_socket, device,
                                                                    grad_mul):
    """overlap=True with delay=1 (protocol 8): dosd copies each delayed
    subgroup's gradients once backward marks it ready; gradients written in
    place after that (halved here, as an in-place clip or unscale would) are
    copied again at the verdict. Either way the run is torch's AdamW one step
    late on the gradients step() saw. (An early step is delayed as the flag
    stood at its begin: on CUDA, where step() returns before its result, the
    delay starts a step later than on the CPU path.)"""
    steps = 20
    data = make_data(n=steps)
    model = make_mlp().to(device)
    cuda = device == "cuda"
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, socket=dos_socket,
                          client_name="pytest-delay-early", model=model, delay=1,
                          delay_warmup=2, overlap=True, subgroup_size=300,
                          **({"gpu_budget_bytes": 0} if cuda else {}))
    if cuda:
        opt.set_policy("cpu")
    weights, delayed = [], []
    try:
        for t, (x, y) in enumerate(data, 1):
            backward(opt, model, x, y, device, grad_mul)
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            last = opt.last_step
            assert last["step"] == t
            delayed.append(last["delayed_subgroups"] > 0)
            weights.append([p.detach().clone() for p in model.parameters()])
        opt.synchronize()
        final = [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()
    exact = delayed.index(True)  # exact steps before the first delayed one
    assert exact in (2, 3) and all(delayed[exact:]), delayed
    seen, master = reference(data, exact, device=device, grad_mul=grad_mul)
    for t in range(1, steps + 1):
        check(model_of(weights[t - 1], device), seen[t], t)
    assert_same(model_of(final, device), master, steps)


@pytest.mark.skipif(not HOOKS, reason="overlap=True needs torch >= 2.1 "
                    "(register_post_accumulate_grad_hook)")
@pytest.mark.parametrize("device,mode", [(d, m) for d in DEVICES
                                         for m in ("1", "stream", "unset")
                                         if d == "cuda" or m == "1"])
@pytest.mark.parametrize("max_norm,grad_mul", [(0.05, 1.0), (1e6, 1.0), (0.05, 0.5)])
def test_torchs_in_place_clip_keeps_the_gradients_copied_during_backward(device, mode, max_norm,
                                                                         grad_mul, monkeypatch):
    """torch.nn.utils.clip_grad_norm_ in place (the Hugging Face Trainer's,
    Lightning's) beside a delayed step's captures (dos/_inplace.py, protocol
    9): dosd keeps the gradients it copied during backward and multiplies
    them by torch's coefficient (dosd's debug line: rewritten=0, scaled_by
    the coefficient), whether it clips (0.05) or not (1e6: c = 1). Written
    before the clip too (halved: grad_mul 0.5) they are copied again
    (rewritten=1). Either way the run is torch's AdamW one step late on the
    clipped gradients, its moments included (a coefficient applied twice or
    not at all would scale exp_avg). Opt-in on the CPU:
    DOS_TORCH_CLIP_SCALED=1; =stream is the default on CUDA (`unset`: the
    variable unset, the same checks as stream). With =stream (protocol 11,
    CUDA) the coefficient reaches dosd through the trainer's stream: dosd's
    step.stream_coef line has it, and the early_capture line's scaled_by is
    the placeholder 1. A finite norm of order 2 over every gradient is proof
    that they are finite: the verdict says kStepGradientsChecked and dosd
    does not scan (scanned=0)."""
    import os
    import re
    from conftest import running_dosd
    steps = 12
    data = make_data(n=steps)
    cuda = device == "cuda"
    import dos._flight
    norms, delayed, checked = [], [], []
    if mode == "unset":
        monkeypatch.delenv("DOS_TORCH_CLIP_SCALED", raising=False)
    else:
        monkeypatch.setenv("DOS_TORCH_CLIP_SCALED", mode)
    verdict = dos._flight.Flight.verdict

    def record(self, args, *a, **kw):
        checked.append(args is not None and bool(args.gradients_checked))
        return verdict(self, args, *a, **kw)
    monkeypatch.setattr(dos._flight.Flight, "verdict", record)
    with running_dosd("--log_level=debug") as (sock, _):
        model = make_mlp().to(device)
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock, model=model,
                              client_name="pytest-delay-clip", delay=1, delay_warmup=2,
                              overlap=True, subgroup_size=300,
                              **({"gpu_budget_bytes": 0} if cuda else {}))
        if cuda:
            opt.set_policy("cpu")
        try:
            for x, y in data:
                backward(opt, model, x, y, device, grad_mul)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                  max_norm)))
                opt.step()
                delayed.append(opt.last_step["delayed_subgroups"] > 0)
            opt.synchronize()
            final = [p.detach().clone() for p in model.parameters()]
            moments = [s["exp_avg"].clone() for s in opt.state_dict()["state"].values()]
        finally:
            opt.close()
        with open(os.path.join(os.path.dirname(sock), "dosd.log")) as f:
            log = [ln for ln in f]
    lines, coefs = ([dict(re.findall(r"(\w+)=(\S+)", ln)) for ln in log
                     if f"event=step.{e}" in ln] for e in ("early_capture", "stream_coef"))
    exact = delayed.index(True)
    torch_opt = []
    _, master = reference(data, exact, device=device, grad_mul=grad_mul, clip=max_norm,
                          opts=torch_opt)
    assert_same(model_of(final, device), master, steps)
    ref_moments = [torch_opt[0].state[p]["exp_avg"] for p in master.parameters()]
    for m, r in zip(moments, ref_moments):
        assert torch.allclose(m.to(r.device), r, rtol=1e-5, atol=1e-9), (m, r)
    assert len(lines) == steps - exact, lines
    # Line k is step exact + 1 + k's; the first follows an exact step, whose
    # clip was a rewrite, so it copied only weights during backward.
    stream = mode in ("stream", "unset") and grad_mul == 1.0
    for k, f in enumerate(lines[1:], 1):
        if grad_mul != 1.0:
            assert f["rewritten"] == "1", f
        else:
            assert f["rewritten"] == "0" and f["copied_gradients"] == "1", f
            clipped = norms[exact + k] + 1e-6 > max_norm
            assert (float(f["scaled_by"]) < 1) == (clipped and not stream), (f, norms)
    # The verdicts that reported a scale said the gradients were checked.
    tail = checked[-(steps - exact - 1):]
    assert tail == [grad_mul == 1.0] * len(tail), checked
    if not stream:
        assert coefs == [], coefs
        return
    # One line a step from the second delayed one on; the last is step `steps`'s.
    assert len(coefs) >= steps - exact - 1, coefs
    for f, norm in zip(reversed(coefs), reversed(norms)):
        assert f["copied_gradients_kept"] == "1" and f["scanned"] == "0", f
        assert (float(f["coef"]) < 1) == (norm + 1e-6 > max_norm), (f, norm)


def model_of(weights, device):
    m = make_mlp().to(device)
    with torch.no_grad():
        for p, w in zip(m.parameters(), weights):
            p.copy_(w)
    return m


def test_readers_see_whole_steps(dos_socket, tmp_path):
    data = make_data(n=8)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, model=model,
                          client_name="pytest-delay-readers", delay=1, delay_warmup=0)
    try:
        for x, y in data[:4]:
            backward(opt, model, x, y, "cpu")
            opt.step()
        behind = [p.detach().clone() for p in model.parameters()]
        # The optimizer's state: step 4's, whole (dosd never shows half a step).
        sd = opt.state_dict()
        assert all(s["step"] == 4 for s in sd["state"].values())
        # It also installed the pending weights: the model is step 4's and
        # differs from what it held before (step 3's).
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), behind))
        masters = [opt.state[p] for p in model.parameters()]
        assert all(m["step"] == 4 for m in masters)
        del sd, masters  # held, they would keep the steps exact (dos/_views.py)
        # Training goes on delayed; a framework's save (module state_dict()
        # through the model's hooks) installs too.
        for x, y in data[4:]:
            backward(opt, model, x, y, "cpu")
            opt.step()
        assert opt.last_step["delayed_subgroups"] > 0
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(saved, tmp_path / "model.pt")
        sd = opt.state_dict()
        ref = make_mlp()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        ref_opt.load_state_dict(sd)
        # The saved weights are the optimizer state's step: whole, not mixed.
        for (name, w), s in zip(saved.items(), sd["state"].values()):
            assert s["step"] == 8, name
        again = {k: v for k, v in model.state_dict().items()}
        for k in saved:
            assert torch.equal(saved[k], again[k])
    finally:
        opt.close()


def test_an_evaluation_forward_sees_whole_steps(dos_socket):
    """The HF Trainer's evaluate() and Lightning's validation run the model
    in eval mode between steps: such a forward installs the pending update
    first, so its metrics are of the step the optimizer state holds (and a
    checkpoint they select); training forwards leave it pending."""
    data = make_data(n=6)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, model=model,
                          client_name="pytest-delay-eval", delay=1, delay_warmup=0)
    try:
        for x, y in data[:5]:
            backward(opt, model, x, y, "cpu")
            opt.step()
        assert opt.last_step["delayed_subgroups"] > 0
        behind = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            model(data[5][0])  # a training-mode forward: still pending
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), behind))
        model.eval()
        model(data[5][0])  # computing gradients: not an evaluation, still pending
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), behind))
        with torch.no_grad():
            model[0](data[5][0])  # one layer's forward, as a validation_step may call
        model.train()
        evaluated = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(evaluated, behind))
        opt.synchronize()  # would install what is pending: nothing is left
        assert all(torch.equal(a, b) for a, b in zip(evaluated, model.parameters()))
    finally:
        opt.close()


def test_delay_arguments_are_checked(dos_socket):
    model = make_mlp()
    with pytest.raises(ValueError, match="model="):
        dos.torch.AdamW(model.parameters(), socket=dos_socket, delay=1)
    with pytest.raises(ValueError, match="delay=2"):
        dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, delay=2)
    if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        with pytest.raises(ValueError, match="overlap"):
            dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, delay=1,
                            overlap="update")
    with pytest.raises(ValueError, match="delay_warmup"):
        dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, delay=1,
                        delay_warmup=-1)


def test_an_early_delayed_runs_warm_up_asks_dosd_nothing_during_a_step(dos_socket):
    """overlap=True (the default for delay=1 on CUDA) begins each step during
    backward, holding the session until step()'s verdict. The warm-up once
    fetched dosd's step count at the first step() (before any report), which
    waited behind that step until it timed out (dosd now refuses at once)."""
    model = make_mlp()
    data = make_data(n=5)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, lr=1e-3, model=model, delay=1,
                         delay_warmup=2, subgroup_size=300,
                         **({"overlap": True} if HOOKS else {})) as opt:
        if not HOOKS:  # the hooks' body by hand (torch < 2.1 has no such hooks)
            opt.overlap = True
            opt._parts.configure(True)
        assert opt._parts.overlap is True
        for i, (x, y) in enumerate(data, 1):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if not HOOKS:
                for e in reversed(opt._entries):
                    opt._parts.driver.on_ready(e)
            opt.step()
            assert opt.last_step["step"] == i
            assert (opt.last_step["delayed_subgroups"] > 0) == (i > 2), opt.last_step


def test_a_load_sets_the_warm_up_to_the_loaded_step_count(dos_socket):
    """A rollback after stepping (or a later checkpoint loaded into an
    optimizer that stepped) counts the warm-up from the loaded step count,
    not from this optimizer's last report."""
    data = make_data(n=12)
    model = make_mlp()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, lr=1e-3, model=model, delay=1,
                         delay_warmup=5) as opt:
        def one(x, y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            return opt.last_step["step"], opt.last_step["delayed_subgroups"] > 0
        for x, y in data[:2]:
            one(x, y)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        for x, y in data[2:10]:
            assert one(x, y)[1] == (opt.last_step["step"] > 5)
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        # A step a GradScaler skips (torch 2.x's protocol: found_inf set
        # around step()) counts nothing, also right after the load.
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(data[2][0]), data[2][1]).backward()
        opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
        opt.step()
        del opt.grad_scale, opt.found_inf
        assert opt.last_step["found_inf"]
        for x, y in data[2:5]:
            step, delayed = one(x, y)
            assert not delayed, f"step {step} of the warm-up was delayed"


def test_state_dict_with_an_update_pending_is_the_last_step(dos_socket):
    """dosd's state is whole after a delayed step: torch's AdamW loaded from
    its state_dict() has every tensor at the last step, and reading it
    installed the last step's weights into the model."""
    data = make_data(n=6)
    seen, master = reference(data, warmup=0)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, socket=dos_socket,
                          model=model, client_name="pytest-delay-state", delay=1,
                          delay_warmup=0)
    try:
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        check(model, seen[len(data)], len(data))  # step 5's weights in the model
        fresh = make_mlp()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=1e-2)
        fresh_opt.load_state_dict(opt.state_dict())
        assert all(s["step"] == len(data) for s in fresh_opt.state_dict()["state"].values())
        assert_same(model, master, len(data))  # state_dict() installed step 6
    finally:
        opt.close()


@pytest.mark.parametrize("move", ["clone", "bf16"])
def test_storage_replaced_with_an_update_pending_loses_no_step(dos_socket, move):
    """`.data` replaced while a delayed update is pending (a clone, or
    model.to(bfloat16)): the new storage holds what the model held, the step
    before's weights, which are no new values of the user's. The step after
    (at lr 0, so that it shows the masters it started from) keeps the pending
    step's masters: they once took the copy as the user's weights, and that
    step's update was lost for good (a hostile review's finding)."""
    data = make_data(n=5)

    def masters(moved):
        model = make_mlp()
        opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, model=model,
                              client_name="pytest-delay-moved", delay=1, delay_warmup=0)
        try:
            for i, (x, y) in enumerate(data):
                if i == len(data) - 1:
                    for g in opt.param_groups:
                        g["lr"] = 0.0
                    if moved and move == "clone":
                        model[0].weight.data = model[0].weight.data.clone()
                    elif moved:
                        model.to(torch.bfloat16)
                dtype = next(model.parameters()).dtype
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the re-registration's warning
                    opt.step()
            opt.synchronize()
            return [s.get("master_param", p).detach().float().clone() for p, s in
                    zip(model.parameters(), opt.state_dict()["state"].values())]
        finally:
            opt.close()

    for i, (a, b) in enumerate(zip(masters(moved=True), masters(moved=False))):
        assert torch.equal(a, b), f"tensor {i}: the pending step's update was lost"


def test_a_read_between_forward_and_backward_fails_the_backward(dos_socket):
    """A read that installs the pending weights (here the model's
    state_dict(), a save on a loss spike) after the forward and before its
    backward changed weights that forward's graph saved: the backward fails
    as it does after torch's own in-place update of them, instead of mixing
    two steps' weights into one gradient (dosd's writes once moved no
    version counter: a hostile review's finding). Without a pending update
    the read writes nothing and the backward goes on."""
    data = make_data(n=5)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, model=model,
                          client_name="pytest-delay-fwd-read", delay=1, delay_warmup=0)
    try:
        for x, y in data[:3]:
            backward(opt, model, x, y, "cpu")
            opt.step()
        x, y = data[3]
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.state_dict()  # installs step 3's weights
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.state_dict()  # nothing pending: nothing written
        loss.backward()
        opt.step()
    finally:
        opt.close()


def test_parameters_outside_model_are_named_in_a_warning(dos_socket):
    """delay=1 installs the pending update through model='s hooks: a
    parameter the optimizer updates outside that module (a head beside the
    body) is read around them, so the constructor names it."""
    body, head = make_mlp(), torch.nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match="1 optimized parameter.s. are not in model="):
        opt = dos.torch.AdamW(list(body.parameters()) + [head.weight], socket=dos_socket,
                              model=body, client_name="pytest-delay-outside", delay=1)
    opt.close()


def test_a_skipped_step_reports_every_key(dos_socket):
    """A step the GradScaler skips (torch 2's protocol: grad_scale and
    found_inf set around step()) reports the keys every step does, the
    delayed counts at 0 (they were missing: KeyError)."""
    data = make_data(n=3)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model,
                          client_name="pytest-delay-skip", delay=1, delay_warmup=0)
    try:
        keys = None
        for t, (x, y) in enumerate(data):
            backward(opt, model, x, y, "cpu")
            if t == 2:
                opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
            opt.step()
            if t == 1:
                keys = set(opt.last_step)
        assert opt.last_step["skipped"] and opt.last_step["delayed_subgroups"] == 0
        assert keys <= set(opt.last_step), keys - set(opt.last_step)
    finally:
        opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_both_kinds_of_skipped_step_leave_the_same_weights(dos_socket, overlap):
    """A step skipped for non-finite gradients, found by the GradScaler
    (torch 2's protocol: the client skips without asking dosd) or by dosd's
    own scan, installs the update the step before left pending: the same
    weights after the skip and the same run after it (the GradScaler's skip
    left the older weights in the model, and the runs parted)."""
    data = make_data(n=8)

    def run(how):
        model = make_mlp()
        opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, lr=1e-2,
                              client_name=f"pytest-delay-skip-{how}", delay=1, delay_warmup=0,
                              overlap=overlap)
        seen = []
        try:
            for t, (x, y) in enumerate(data, 1):
                backward(opt, model, x, y, "cpu")
                if t == 5 and how == "scaler":
                    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
                elif t == 5:
                    with torch.no_grad():
                        next(model.parameters()).grad.view(-1)[0] = float("inf")
                opt.step()
                if t == 5 and how == "scaler":
                    del opt.grad_scale, opt.found_inf
                seen.append([p.detach().clone() for p in model.parameters()])
        finally:
            opt.close()
        return seen

    scaler, scan = run("scaler"), run("dosd")
    for t, (a, b) in enumerate(zip(scaler, scan), 1):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"after step {t}"


@pytest.mark.parametrize("subgroup_size", [0, 300])
def test_per_layer_waits_on_the_cpu_path(dos_socket, subgroup_size):
    """async_step=True with model= on the CPU: step() returns at once, each
    layer's forward waits on the host for its subgroups (dos/_hooks.py); the
    delayed run is still torch's AdamW one step late, weight for weight."""
    data = make_data(n=40)
    seen, master = reference(data, 3)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, socket=dos_socket,
                          client_name="pytest-delay-async", model=model, async_step=True,
                          delay=1, delay_warmup=3, subgroup_size=subgroup_size)
    try:
        for t, (x, y) in enumerate(data, 1):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert opt.last_step["step"] == t  # collects; a report installs nothing
            check(model, seen[t], t)
        opt.synchronize()
        assert_same(model, master, len(data))
    finally:
        opt.close()


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_a_framework_save_with_an_update_pending_resumes_whole(dos_socket, tmp_path, device,
                                                                warmup):
    """What a framework does at a checkpoint (the model's state_dict() and the
    optimizer's, torch.save, then in a new optimizer load_state_dict of both)
    with a delayed update pending: the saved weights and state are one whole
    step, and the resumed run goes on as torch's AdamW one step late from
    there. On CUDA half the subgroups are resident beside the delayed ones.
    warmup 3: the warm-up counts dosd's steps, the loaded ones too, so the
    resumed run's first step is delayed as the saving run's next would have
    been (it once ran exact: the count began again at the new optimizer)."""
    save_and_resume(dos_socket, tmp_path, device, warmup)


def make_wide(seed=0):
    """67M parameters: an update on dosd's host path (about 2 GB of host
    memory moved) that outlasts the trainer's forward and backward of
    make_data's batches, so that the next step begins beside it."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 8192), torch.nn.Tanh(),
                               torch.nn.Linear(8192, 8192), torch.nn.Tanh(),
                               torch.nn.Linear(8192, 4))


def train_early_delayed(device, steps, *flags):
    """make_wide trained `steps` steps with delay=1 and overlap=True on a
    dosd of its own (`flags`): the weights after each step, the final ones
    after synchronize(), and dosd's `delayed.update` debug lines."""
    import os
    from conftest import running_dosd
    data = make_data(n=steps)
    cuda = device == "cuda"
    with running_dosd("--log_level=debug", *flags) as (sock, _):
        model = make_wide().to(device)
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock, model=model,
                              client_name="pytest-delay-handoff", delay=1, delay_warmup=2,
                              overlap=True, subgroup_size=1 << 24,
                              **({"gpu_budget_bytes": 0} if cuda else {}))
        if cuda:
            opt.set_policy("cpu")
        weights = []
        try:
            for x, y in data:
                backward(opt, model, x, y, device, 1.0)
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                weights.append([p.detach().clone() for p in model.parameters()])
            opt.synchronize()
            final = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
        with open(os.path.join(os.path.dirname(sock), "dosd.log")) as f:
            updates = [ln for ln in f if "event=delayed.update" in ln]
    return weights, final, updates


@pytest.mark.skipif(not HOOKS, reason="overlap=True needs torch >= 2.1 "
                    "(register_post_accumulate_grad_hook)")
@pytest.mark.parametrize("device", DEVICES)
def test_a_handed_off_update_changes_no_bit(device):
    """dosd's hand-off (--delayed_handoff, on by default): the trainer's
    next early step begins while the last delayed update still runs, and its
    copies during backward take each subgroup as the update finishes it. The
    weights after every step and at the end are bit for bit those of the
    same run with --delayed_handoff=false (itself AdamW one step late: the
    tests above), and dosd's log says which updates were handed off. On
    CUDA some must be: this model's update outlasts its forward and
    backward there (as on nvidia-h100); torch's CPU forward and backward
    of it outlast the update."""
    steps = 8
    weights, final, updates = train_early_delayed(device, steps, "--delayed_handoff=false")
    h_weights, h_final, h_updates = train_early_delayed(device, steps)
    for t in range(steps):
        for a, b in zip(h_weights[t], weights[t]):
            assert torch.equal(a, b), f"step {t + 1}"
    assert all(torch.equal(a, b) for a, b in zip(h_final, final))
    assert not [ln for ln in updates if "handed_off=true" in ln], updates
    if device == "cuda":
        assert [ln for ln in h_updates if "handed_off=true" in ln], h_updates


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the delayed GPU path streams through a GPU (no CUDA here)")
def test_a_save_with_a_gpu_update_pending_resumes_whole(tmp_path):
    """The same with dosd --delayed_gpu_first: the pending update the save
    waits for runs on the GPU (every delayed subgroup under static:0.5)."""
    from conftest import running_dosd
    with running_dosd("--delayed_gpu_first") as (sock, _):
        save_and_resume(sock, tmp_path, "cuda")


def save_and_resume(dos_socket, tmp_path, device, warmup=0):
    data = make_data(n=12)
    cuda = device == "cuda"
    delayed_from = 900 if cuda else 0
    seen, master = reference(data[:6], warmup, device=device, delayed_from=delayed_from)
    kw = dict(lr=1e-3, weight_decay=1e-2, socket=dos_socket, delay=1, delay_warmup=warmup,
              subgroup_size=300)

    def make(name):
        model = make_mlp().to(device)
        opt = dos.torch.AdamW(model.parameters(), client_name=name, model=model, **kw)
        if cuda:
            opt.set_policy("static:0.5")
        return model, opt

    def train(model, opt, batch):
        for x, y in batch:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()

    model, opt = make("pytest-delay-save")
    try:
        train(model, opt, data[:6])
        assert opt.last_step["delayed_subgroups"] > 0
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    finally:
        opt.close()
    saved = torch.load(tmp_path / "ckpt.pt")
    assert all(s["step"] == 6 for s in saved["opt"]["state"].values())
    check_state = make_mlp().to(device)
    check_state.load_state_dict(saved["model"])
    assert_same(check_state, master, 6)  # whole: every weight is step 6's
    # Resume in a new optimizer; the delay goes on from step 7.
    seen, master = reference(data[6:], 0, device=device, delayed_from=delayed_from,
                             start=(saved["model"], saved["opt"]))
    model, opt = make("pytest-delay-resume")
    try:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        for t, batch in enumerate(data[6:], 1):
            train(model, opt, [batch])
            assert opt.last_step["step"] == 6 + t
            check(model, seen[t], 6 + t)
        opt.synchronize()
        assert_same(model, master, 12)
    finally:
        opt.close()


@pytest.mark.parametrize("flag", ["--host_memory_limit", "--session_memory_limit"])
def test_a_delay_past_the_host_memory_limit_fails_cleanly(flag):
    """A dosd whose --host_memory_limit (or the session's
    --session_memory_limit) holds the state but not the delayed update's
    capture buffers: the first delayed step raises RESOURCE_EXHAUSTED
    naming the flag and delay=0, applies nothing (the state and the weights
    stay the last exact step's), and the state moves to an optimizer
    without the delay, which goes on."""
    from conftest import running_dosd
    from dos import DosError
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 65792 parameters: 0.79 MB of state
    x, y = torch.randn(8, 256), torch.randn(8, 256)

    def one_step(opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    with running_dosd(f"{flag}=1M") as (sock, _):
        opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=sock, model=model,
                              client_name="pytest-delay-limit", delay=1, delay_warmup=1)
        try:
            one_step(opt)  # exact (the warm-up)
            exact = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(DosError) as err:
                one_step(opt)
            text = str(err.value)
            assert "RESOURCE_EXHAUSTED" in text or err.value.code.name == "RESOURCE_EXHAUSTED"
            assert flag in text and "delay=0" in text, text
            sd = opt.state_dict()
            assert all(int(float(s["step"])) == 1 for s in sd["state"].values())
            for p, q in zip(model.parameters(), exact):
                assert torch.equal(p.detach(), q)
        finally:
            opt.close()
        opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=sock,
                              client_name="pytest-delay-limit-exact")
        try:
            opt.load_state_dict(sd)
            one_step(opt)
            assert opt.last_step["step"] == 2
        finally:
            opt.close()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the delayed GPU path streams through a GPU (no CUDA here)")
@pytest.mark.parametrize("flag", ["--delayed_gpu_path", "--delayed_gpu_first",
                                  "--delayed_gpu_staged", "--delayed_gpu_kernel_blocks=3"])
def test_the_delayed_gpu_path_is_adamw_one_step_late(flag):
    """dosd --delayed_gpu_path: the subgroups interleave:2 streams are
    delayed too, updated on the GPU during the window from the gradients
    captured at the step; with the host path's, every subgroup is one step
    late (a streamed one applied at once would not match).
    --delayed_gpu_first: the GPU updates the host path's too (by rule all).
    --delayed_gpu_staged: its gradients and weights cross by the copy engines
    through the staging slots; --delayed_gpu_kernel_blocks: its kernels read
    them over PCIe on a grid of 3 blocks. The same bits either way."""
    data = make_data(n=STEPS)
    seen, master = reference(data, 3, device="cuda", delayed_from=0)
    from conftest import running_dosd
    with running_dosd(flag, "--log_level=debug") as (sock, _):
        model = make_mlp().cuda()
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, socket=sock,
                              client_name="pytest-delay-gpu", model=model, delay=1,
                              delay_warmup=3, subgroup_size=300, gpu_budget_bytes=0)
        opt.set_policy("interleave:2")
        try:
            for t, (x, y) in enumerate(data, 1):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
                opt.step()
                torch.cuda.synchronize()
                assert (opt.last_step["delayed_subgroups"] > 0) == (t > 3)
                check(model, seen[t], t)
            opt.synchronize()
            assert_same(model, master, STEPS)
            # A whole step in a state_dict: the pending GPU update finished.
            state = opt.state_dict()
            assert len(state["state"]) > 0
        finally:
            opt.close()
    assert_same(model, master, STEPS)


@pytest.mark.parametrize("device", DEVICES)
def test_each_delayed_update_logs_its_time_and_the_idle_before_it(device):
    """--log_level=debug: one `delayed.update` line per delayed update (the
    operator guide's fields): its time, its start after an early step's
    verdict (0 without one: the CPU path's steps begin at step()), and the
    host path's idle time since the last update (0 for the first)."""
    import os
    import re
    from conftest import running_dosd
    data = make_data(n=8)
    warmup = 2
    with running_dosd("--log_level=debug") as (sock, _):
        model = make_mlp().to(device)
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock, model=model,
                              client_name="pytest-delay-log", delay=1, delay_warmup=warmup,
                              **({"gpu_budget_bytes": 0} if device == "cuda" else {}))
        if device == "cuda":
            opt.set_policy("cpu")  # every subgroup on the host path: all delayed
        try:
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
                opt.step()
            opt.synchronize()
        finally:
            opt.close()
        with open(os.path.join(os.path.dirname(sock), "dosd.log")) as f:
            lines = [ln for ln in f if "event=delayed.update" in ln]
    # Steps warmup+1 .. 8 are delayed; each one's update runs once.
    assert len(lines) == len(data) - warmup, lines
    fields = [dict(re.findall(r"(\w+)=(\S+)", ln)) for ln in lines]
    for f in fields:
        assert float(f["update_us"]) > 0, f
        # The CPU kernel's own time is part of it, over every delayed parameter here.
        assert 0 < float(f["kernel_us"]) <= float(f["update_us"]), f
        assert int(f["kernel_params"]) == sum(p.numel() for p in model.parameters()), f
        if device == "cpu":
            assert float(f["start_after_verdict_us"]) == 0, f
    # Between two updates the host path idled for the trainer's step.
    assert float(fields[0]["idle_before_us"]) == 0, fields[0]
    assert all(float(f["idle_before_us"]) > 0 for f in fields[1:]), fields


@pytest.mark.parametrize("device", DEVICES)
def test_weights_written_with_a_delay_pending_are_warned_about(dos_socket, device):
    """A write in place while a delayed update is pending: the next step
    warns (the pending weights are installed over the write for the delayed
    subgroups). After synchronize() the write is whole and taken as dosd's
    masters, silently."""
    data = make_data(n=6)
    model = make_mlp().to(device)
    cuda = {"gpu_budget_bytes": 0} if device == "cuda" else {}  # every subgroup on the CPU path
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket, model=model,
                         delay=1, delay_warmup=1, **cuda) as opt:
        if cuda:
            opt.set_policy("cpu")
        for t, (x, y) in enumerate(data[:3], 1):
            backward(opt, model, x, y, device)
            opt.step()
        assert opt.last_step["delayed_subgroups"] > 0
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        backward(opt, model, *data[3], device)
        with pytest.warns(RuntimeWarning, match="pending"):
            opt.step()
        opt.synchronize()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        backward(opt, model, *data[4], device)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
        opt.synchronize()
        # lr 0: the step moved nothing; the masters are the zeros written.
        for s in opt.state_dict(all_params=True)["state"].values():
            assert "master_param" not in s
        assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
