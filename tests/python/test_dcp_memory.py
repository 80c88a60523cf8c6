"""torch.distributed.checkpoint's load into the optimizer's own state dict
(dos/_dcp.py): DCP copies the checkpoint into the dict's tensors, views
of dosd's memory whose written pages became the trainer's own, a second copy
of the state (81 GB at 7B). Where memory is short the views are moved onto a
file first: the trainer's anonymous memory does not grow, the load resumes
exactly, a view the load did not write stays dosd's, a failed load leaves
every view as it was, and with no disk the load is refused before it reads.

DCP itself cannot be imported with Debian's torch 1.13, so most cases use a
stand-in with DCP's contract (Stateful values asked for their state dict,
the checkpoint copied into the leaves in place, then load_state_dict); the
last case runs the real one where torch >= 2.3 has it."""

import gc
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import _carry, _dcp, _views  # noqa: E402
from test_state_io import daemon_state  # noqa: E402
from test_state_views import LR, big_model, rss_anon, train  # noqa: E402

DCP = "torch.distributed.checkpoint"


def flat(sd):
    return {f"optim.{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items()}


def leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


def stand_in(saved, fail_after=None):
    """A torch.distributed.checkpoint module whose load has DCP's contract."""
    mod = types.ModuleType(DCP)

    def load(state_dict, checkpoint_id=None):
        stateful = {k: v for k, v in state_dict.items()
                    if not isinstance(v, (dict, torch.Tensor)) and hasattr(v, "load_state_dict")}
        inner = {k: (v.state_dict() if k in stateful else v) for k, v in state_dict.items()}
        done = 0
        for key, t in leaves(inner):
            if key in saved:
                if done == fail_after:
                    raise RuntimeError("a test: the storage failed mid-load")
                getattr(t, "_local_tensor", t).copy_(saved[key])
                done += 1
        for k, v in stateful.items():
            v.load_state_dict(inner[k])
    mod.load = load
    return mod


@pytest.fixture
def spill(monkeypatch, tmp_path):
    """Memory is short: moved views go to a file in a fresh DOS_SPILL_DIR."""
    monkeypatch.setenv("DOS_SPILL", "always")
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    return tmp_path


def checkpoint(dos_socket, compact=False):
    """A model trained 2 steps, its optimizer state as DCP would have saved
    it (flat, cloned), and the weights 2 more steps reach from there."""
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, compact_state=compact,
                         **LR) as opt:
        train(model, opt, 2)
        saved = {k: v.clone() for k, v in flat(opt.state_dict()).items()}
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, 2, seed=9)
        want = [p.detach().clone() for p in model.parameters()]
    return saved, weights, want


def resumed(dos_socket, weights, compact=False):
    """Another model and optimizer, trained elsewhere, its weights the checkpoint's."""
    model = big_model(seed=4)
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, compact_state=compact, **LR)
    train(model, opt, 1, seed=5)
    model.load_state_dict(weights)
    opt.reload_weights()
    return model, opt


def install(monkeypatch, saved, **kw):
    monkeypatch.setitem(sys.modules, DCP, stand_in(saved, **kw))
    _dcp.install()
    return sys.modules[DCP]


def spill_maps(spill):
    """This process's mappings of files in the spill directory."""
    with open("/proc/self/maps") as f:
        return [ln for ln in f if str(spill) in ln]


@pytest.mark.parametrize("how,compact", [("dict", False), ("stateful", False),
                                         ("dict", True)])
def test_dcp_load_into_views_resumes_exactly_without_a_copy_in_memory(dos_socket, spill,
                                                                      monkeypatch, how,
                                                                      compact):
    saved, weights, want = checkpoint(dos_socket, compact)
    model, opt = resumed(dos_socket, weights, compact)
    dcp = install(monkeypatch, saved if how == "dict" else {f"app.{k}": v for k, v in saved.items()})
    with opt:
        sd = opt.state_dict(all_params=True)
        views = views_of(sd)
        assert len(views) >= 4  # the weights' moments at least
        state_bytes = sum(t.numel() * t.element_size() for t in views)
        if how == "stateful":
            del sd, views  # no view alive before the load: the App makes them
        before = rss_anon()
        if how == "dict":
            dcp.load(flat(sd))
        else:
            class App:  # torch's AppState pattern: the dict made inside the load
                def state_dict(self):
                    self.sd = opt.state_dict(all_params=True)
                    return flat(self.sd)  # keys app.optim.*

                def load_state_dict(self, loaded):
                    assert not views_of(self.sd)  # every one written, none left over dosd
                    opt.load_state_dict(self.sd)
            dcp.load({"app": App()})
        grew = rss_anon() - before
        assert grew < state_bytes // 4, (grew, state_bytes)  # the pages went to the file
        if how == "dict":
            assert all(not _views.over_dosd(t) for t in views)  # the same tensors, moved
            assert views[1].dtype == (torch.bfloat16 if compact else torch.float32)
            for key, t in leaves(flat(sd)):
                assert torch.equal(t, saved[key]), key
            assert spill_maps(spill)
            opt.load_state_dict(sd)
            del sd, views, t
        gc.collect()
        assert spill_maps(spill) == []  # the file went with the dict's tensors
        train(model, opt, 2, seed=9)
        for a, b in zip(want, model.parameters()):
            assert torch.equal(a, b.detach())
    assert os.listdir(spill) == []  # unnamed


def views_of(sd):
    return [t for _, t in leaves(flat(sd)) if _views.over_dosd(t)]


def test_the_copy_in_memory_the_file_avoids_is_real(dos_socket, monkeypatch):
    """DOS_SPILL=never: the pages DCP writes are the trainer's (the old way)."""
    monkeypatch.setenv("DOS_SPILL", "never")
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, saved)
    with opt:
        sd = opt.state_dict(all_params=True)
        big = views_of(sd)
        state_bytes = sum(t.numel() * t.element_size() for t in big)
        before = rss_anon()
        dcp.load(flat(sd))
        assert rss_anon() - before > state_bytes * 3 // 4
        assert all(_views.over_dosd(t) for t in big)


def test_a_view_the_load_did_not_write_stays_dosds(dos_socket, spill, monkeypatch):
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    only_m = {k: v for k, v in saved.items() if not k.endswith("exp_avg_sq")}
    dcp = install(monkeypatch, only_m)
    with opt:
        sd = opt.state_dict(all_params=True)
        before = [daemon_state(opt, e) for e in opt._entries]
        mapped = {k for k, t in leaves(flat(sd)) if _views.over_dosd(t)}
        assert mapped
        dcp.load(flat(sd))
        for key, t in leaves(flat(sd)):
            if key in mapped:
                assert _views.over_dosd(t) == key.endswith("exp_avg_sq"), key
        opt.load_state_dict(sd)
        for e, (old, _) in zip(opt._entries, before):
            new = daemon_state(opt, e)[0]
            assert torch.equal(new[2], old[2])  # exp_avg_sq as it was
        for key, t in leaves(flat(opt.state_dict())):
            if key.endswith(".exp_avg"):
                assert torch.equal(t, saved[key]), key


def test_a_failed_load_leaves_every_view_as_it_was(dos_socket, spill, monkeypatch):
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, saved, fail_after=2)
    with opt:
        sd = opt.state_dict(all_params=True)
        old = {k: t.clone() for k, t in leaves(flat(sd))}
        mapped = {k for k, t in leaves(flat(sd)) if _views.over_dosd(t)}
        assert mapped
        with pytest.raises(RuntimeError, match="mid-load"):
            dcp.load(flat(sd))
        for key, t in leaves(flat(sd)):
            if key in mapped:
                assert _views.over_dosd(t), key
                assert torch.equal(t, old[key]), key
    assert os.listdir(spill) == []


def test_with_no_disk_the_load_is_refused_before_it_reads(dos_socket, monkeypatch, tmp_path):
    monkeypatch.setattr(_carry, "available_memory", lambda: 0)
    monkeypatch.setattr(_carry, "_SMALL", 0)
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (0, "a test: no disk"))
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, saved)
    with opt:
        sd = opt.state_dict(all_params=True)
        old = {k: t.clone() for k, t in leaves(flat(sd))}
        with pytest.raises(dos.DosError, match="DOS_SPILL_DIR") as err:
            dcp.load(flat(sd))
        assert err.value.code_name == "RESOURCE_EXHAUSTED"
        assert "Nothing was loaded" in str(err.value) and "a test: no disk" in str(err.value)
        for key, t in leaves(flat(sd)):
            assert torch.equal(t, old[key]), key


def test_real_dcp_load_moves_the_views_to_a_file(dos_socket, spill, tmp_path):
    try:
        import torch.distributed.checkpoint as dcp
    except Exception as e:  # Debian's torch 1.13 on Python 3.11
        pytest.skip(f"torch.distributed.checkpoint cannot be imported here "
                    f"({type(e).__name__}: {str(e)[:120]})")
    if not hasattr(dcp, "load") or torch.__version__ < "2.3":
        pytest.skip("single-process DCP needs torch >= 2.3")
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 2)
        if hasattr(dcp, "async_save"):  # saved here, whole, no staged copy: done at once
            assert dcp.async_save(flat(opt.state_dict()),
                                  checkpoint_id=str(tmp_path / "ckpt")).done()
        else:
            dcp.save(flat(opt.state_dict()), checkpoint_id=str(tmp_path / "ckpt"))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, 2, seed=9)
        want = [p.detach().clone() for p in model.parameters()]
    model, opt = resumed(dos_socket, weights)
    with opt:
        sd = opt.state_dict(all_params=True)
        big = views_of(sd)
        before = rss_anon()
        dcp.load(flat(sd), checkpoint_id=str(tmp_path / "ckpt"))
        assert rss_anon() - before < sum(t.numel() * t.element_size() for t in big) // 4
        assert not any(_views.over_dosd(t) for t in big)
        opt.load_state_dict(sd)
        train(model, opt, 2, seed=9)
        for a, b in zip(want, model.parameters()):
            assert torch.equal(a, b.detach())


def test_async_save_of_views_saves_them_in_place_without_staging(dos_socket, monkeypatch):
    """async_save would stage (copy) the whole state first: a dict holding
    views is saved by save on this thread instead, Stateful values resolved
    once, and a finished future comes back; other dicts go to async_save."""
    mod = types.ModuleType(DCP)
    calls = []

    def save(state_dict, checkpoint_id=None):
        calls.append(("save", state_dict, checkpoint_id))
        return "metadata"

    def async_save(state_dict, checkpoint_id=None, async_checkpointer_type=None):
        calls.append(("async_save", state_dict, checkpoint_id))
        return "a future"
    mod.save, mod.async_save = save, async_save
    monkeypatch.setitem(sys.modules, DCP, mod)
    _dcp.install()
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 2)

        class App:
            def state_dict(self):
                return {"optim": flat(opt.state_dict())}

            def load_state_dict(self, sd):
                raise AssertionError("not a load")
        before = rss_anon()
        fut = mod.async_save({"app": App(), "n": 3}, checkpoint_id="c1",
                             async_checkpointer_type="thread")
        assert fut.done() and fut.result() == "metadata"
        (what, sd, ckpt), = calls
        assert what == "save" and ckpt == "c1" and sd["n"] == 3
        assert any(_views.over_dosd(t) for t in sd["app"]["optim"].values())  # not copies
        assert rss_anon() - before < 8 << 20
        calls.clear()
        assert mod.async_save({"w": torch.ones(3)}, checkpoint_id="c2") == "a future"
        assert calls[0][0] == "async_save"


def test_a_stateful_failing_after_the_read_leaves_every_view_dosds(dos_socket, spill,
                                                                    monkeypatch):
    """A later Stateful value's load_state_dict raises after the dict's views
    were written: they go back onto dosd's memory, showing its state."""
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, saved)

    class Bad:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            raise RuntimeError("a test: a Stateful's load failed")
    with opt:
        sd = opt.state_dict(all_params=True)
        old = {k: t.clone() for k, t in leaves(flat(sd))}
        mapped = {k for k, t in leaves(flat(sd)) if _views.over_dosd(t)}
        with pytest.raises(RuntimeError, match="Stateful's load failed"):
            dcp.load({**flat(sd), "zz": Bad()})
        for key, t in leaves(flat(sd)):  # (the small copies were written, as torch's are)
            assert _views.over_dosd(t) == (key in mapped), key
            assert key not in mapped or torch.equal(t, old[key]), key


def test_memory_counts_every_view_of_one_load(dos_socket, monkeypatch, tmp_path):
    """The dict's views and a Stateful value's are decided together: each
    set fits alone, both do not, so all go to one file."""
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, {**saved, **{f"app.{k}": v for k, v in saved.items()}})
    with opt:
        sd = opt.state_dict(all_params=True)
        one = sum(t.numel() * t.element_size() for t in views_of(sd))
        monkeypatch.setattr(_carry, "available_memory", lambda: one * 3 // 2)
        monkeypatch.setattr(_carry, "_SMALL", 0)
        monkeypatch.setattr(_carry, "_MARGIN", 0)
        monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
        monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
        reserved = []
        real = _carry.reserve
        monkeypatch.setattr(_carry, "reserve", lambda n: reserved.append(n) or real(n))

        class App:
            def state_dict(self):
                self.sd = opt.state_dict(all_params=True)
                return flat(self.sd)

            def load_state_dict(self, loaded):
                assert not views_of(self.sd)
        dcp.load({**flat(sd), "app": App()})
        assert len(reserved) == 1 and reserved[0] >= 2 * one  # one file for the whole load


def test_a_spill_typo_does_not_break_loads_without_views(monkeypatch):
    monkeypatch.setenv("DOS_SPILL", "Auto")
    dcp = install(monkeypatch, {"w": torch.ones(3)})
    d = {"w": torch.zeros(3)}
    dcp.load(d)
    assert torch.equal(d["w"], torch.ones(3))


def test_async_save_answers_as_a_future_and_as_a_response(dos_socket, monkeypatch):
    mod = types.ModuleType(DCP)

    def save(state_dict, checkpoint_id=None):
        raise OSError("a test: the disk is full")
    mod.save = save
    mod.async_save = lambda state_dict, **kw: pytest.fail("staged a copy")
    monkeypatch.setitem(sys.modules, DCP, mod)
    _dcp.install()
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 1)
        fut = mod.async_save(flat(opt.state_dict()), checkpoint_id="c")
        assert fut.done() and fut.staging_completion.done()
        assert fut.upload_completion is fut
        with pytest.raises(OSError, match="disk is full"):
            fut.result()


def spawned(worker, tmp_path, case):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import json
    import torch.multiprocessing as mp
    import dcp_workers
    rdv = str(tmp_path / "rdv")
    mp.spawn(getattr(dcp_workers, worker), args=(2, rdv, str(tmp_path), str(tmp_path), case),
             nprocs=2, join=True)
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for r in reports:
        assert "error" not in r, r
    return reports


@pytest.mark.parametrize("case", ["no disk", "an error", "a stateful error"])
def test_ranks_refuse_together(tmp_path, case):
    """One rank without a disk (or failing before its vote: a DOS_SPILL
    typo) refuses DCP's load: every rank must, or the others would wait in
    DCP's collectives."""
    reports = spawned("refusal_worker", tmp_path, case)
    for r in reports:
        assert not r["moved"] and r["maps"] == [], r
    want = {"no disk": "no disk on this rank", "an error": "DOS_SPILL",
            "a stateful error": "a test: state_dict failed"}[case]
    assert want in reports[1]["refused"], reports[1]
    assert "another rank failed" in reports[0]["refused"], reports[0]


def test_a_stateful_value_on_one_rank_only_keeps_the_ranks_in_step(tmp_path):
    """DCP lets ranks hold different keys: each rank votes once a load
    whatever Stateful values it holds (a vote per value once met DCP's own
    collective on the other rank)."""
    for r in spawned("stateful_worker", tmp_path, ""):
        assert r["loaded"] == [2.0] * 4, r


def test_the_process_group_is_read_from_positional_arguments():
    def load_state_dict(state_dict, storage_reader, process_group=None, coordinator_rank=0,
                        no_dist=False, planner=None):
        pass
    group_of = _dcp._group_reader(load_state_dict)
    assert group_of({}, ("reader", "PG"), {}) == "PG"
    assert group_of({}, ("reader", "PG", 0, True), {}) is False
    assert group_of({}, ("reader",), {"process_group": "G"}) == "G"
    assert group_of({}, (), {}) is None


def fake_dcp_package(monkeypatch, tmp_path, name):
    """A package `name` on sys.path standing for DCP, not imported yet: the hook's."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def load(state_dict, **kw):\n    return 'loaded'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_dcp, "_HOOKED", name)
    monkeypatch.setattr(_dcp, "_WRAPPED", ((name, "load"),))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_dcp_imported_later_is_wrapped_at_its_import(monkeypatch, tmp_path):
    """Wrapped on every rank whichever called state_dict() since the import."""
    fake_dcp_package(monkeypatch, tmp_path, "dos_fake_dcp")
    _dcp.install()  # not imported yet: the hook
    import dos_fake_dcp
    try:
        assert getattr(dos_fake_dcp.load, "_dos_wrapped", False)
        assert dos_fake_dcp.load({"w": torch.ones(2)}) == "loaded"
    finally:
        sys.modules.pop("dos_fake_dcp", None)


def test_a_moved_view_lets_dosds_mapping_go(dos_socket, spill, monkeypatch):
    """A loaded tensor kept (an AppState caching its dict) holds the file,
    not dosd's mapping: the views alive fall back (while any is, steps wait
    to be whole and the delay pauses)."""
    saved, weights, _ = checkpoint(dos_socket)
    model, opt = resumed(dos_socket, weights)
    dcp = install(monkeypatch, saved)
    with opt:
        gc.collect()
        before = _views._live  # mappings of dosd's memory (live() adds the small copies)
        sd = opt.state_dict(all_params=True)
        n = len(views_of(sd))
        assert _views._live >= before + n
        dcp.load(flat(sd))
        gc.collect()
        assert not views_of(sd) and _views._live <= before  # the mappings went
        opt.load_state_dict(sd)


def test_the_import_hook_survives_a_reload_and_a_second_finder(monkeypatch, tmp_path):
    import importlib
    fake_dcp_package(monkeypatch, tmp_path, "dos_fake_dcp2")
    monkeypatch.setattr(sys, "meta_path", [_dcp._Finder(), _dcp._Finder()] + sys.meta_path)
    import copy
    try:
        import dos_fake_dcp2
        assert getattr(dos_fake_dcp2.load, "_dos_wrapped", False)
        copy.copy(dos_fake_dcp2.__spec__.loader)  # no recursion
        importlib.reload(dos_fake_dcp2)
        assert getattr(dos_fake_dcp2.load, "_dos_wrapped", False)
    finally:
        sys.modules.pop("dos_fake_dcp2", None)
