"""dos/_inplace.py's decisions without a daemon (any torch, CPU): what torch's
in-place clip leaves the verdict of a delayed step. The whole path, dosd
included, is test_delay.py's test_torchs_in_place_clip_... (torch >= 2.1)."""

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from dos import _inplace  # noqa: E402


class Driver:
    """The VerdictDriver's side of a clip: captures stop, a Scaled is kept."""

    def __init__(self, on_stream=False, stream=None):
        self.scaled = None
        self._on_stream = on_stream
        self._stream = stream

    def stream(self):
        return self._stream

    def stop_captures(self):
        return True

    def on_stream(self):
        return self._on_stream

    def note_scaled(self, scaled):
        self.scaled = scaled


def params_with_grads(values):
    params = []
    for i, v in enumerate(values):
        p = torch.nn.Parameter(torch.zeros(len(v)))
        p.grad = torch.tensor(v, dtype=torch.float32)
        params.append(p)
    entries = [SimpleNamespace(index=i, grad_shm=p.grad) for i, p in enumerate(params)]
    return params, entries


@pytest.fixture(autouse=True)
def torch_clip(monkeypatch):
    """torch's own clip: once an optimizer earlier in the process installed
    the wrapper (on CUDA by default), torch.nn.utils' is the wrapper."""
    monkeypatch.setattr(_inplace, "_torch_clip",
                        _inplace._torch_clip or torch.nn.utils.clip_grad_norm_)


def clip(values, max_norm, *args, **kwargs):
    params, entries = params_with_grads(values)
    driver = Driver()
    _inplace._clip_scaled(driver, entries, params, max_norm, args, kwargs)
    return driver.scaled, params


def test_a_finite_norm_of_order_two_proves_the_gradients_finite():
    scaled, params = clip([[3.0, 4.0], [0.0, 12.0]], 1.0)
    assert scaled is not None and scaled.proves_finite
    assert scaled.coef == pytest.approx(1.0 / 13.0, rel=1e-5)
    assert scaled.versions == {0: params[0].grad._version, 1: params[1].grad._version}


def test_an_inf_norm_order_is_proof_and_order_zero_is_not():
    scaled, _ = clip([[3.0, 4.0]], 1.0, float("inf"))
    assert scaled.proves_finite and scaled.coef == pytest.approx(0.25, rel=1e-5)
    # Order 0 counts non-zeros: NaN counts as one, the norm stays finite.
    scaled, _ = clip([[3.0, 4.0]], 1.0, norm_type=0)
    assert scaled is not None and not scaled.proves_finite


def test_an_inf_past_the_samples_is_no_proof():
    """An inf makes torch's coefficient 0 (finite): the verdict may report
    the scale (dosd repeats the multiply: inf * 0 = NaN, as the trainer's),
    but never that the gradients are checked, so dosd scans and skips."""
    values = [[1.0] * (_inplace._SAMPLES + 8)]
    values[0][-1] = math.inf
    scaled, _ = clip(values, 1.0)
    assert scaled is not None and scaled.coef == 0.0 and not scaled.proves_finite


def test_the_coefficient_on_the_device_is_nan_unless_it_is_a_scale():
    before = [torch.tensor([2.0, -4.0])]
    coef = torch.tensor(0.5)
    good = _inplace._coef_on_device(coef, torch.tensor(3.0), before, [before[0] * 0.5])
    assert good.shape == (1,) and good.dtype == torch.float32 and float(good) == 0.5
    for total, after in ((torch.tensor(math.inf), before[0] * 0.5),
                         (torch.tensor(math.nan), before[0] * 0.5),
                         (torch.tensor(3.0), before[0] * 0.25)):
        assert math.isnan(float(_inplace._coef_on_device(coef, total, before, [after])))


def test_norm_type_is_read_as_torch_reads_it():
    assert _inplace._norm_type((), {}) == 2.0
    assert _inplace._norm_type((1,), {}) == 1.0
    assert _inplace._norm_type((), {"norm_type": "inf"}) == math.inf
    assert _inplace._norm_type(("two",), {}) == 0.0


def test_an_unknown_mode_is_named_in_a_warning(monkeypatch):
    monkeypatch.setenv("DOS_TORCH_CLIP_SCALED", "true")
    driver = Driver()  # held: a WeakSet forgets a temporary either way
    with pytest.warns(RuntimeWarning, match="DOS_TORCH_CLIP_SCALED='true' is not 0, 1 or stream"):
        _inplace.watch(driver)
    # Not watched (drivers of earlier tests' optimizers may still be alive).
    assert driver not in _inplace._drivers


def test_unset_the_clip_is_kept_through_the_stream_on_cuda_only(monkeypatch):
    """DOS_TORCH_CLIP_SCALED unset: stream where the steps are ordered on a
    CUDA stream, else 0 (torch's clip has the gradients copied again); an
    explicit value wins either way."""
    monkeypatch.delenv("DOS_TORCH_CLIP_SCALED", raising=False)
    assert _inplace.clip_mode(object()) == "stream"
    assert _inplace.clip_mode(None) == "0"
    driver = Driver()
    _inplace.watch(driver)
    assert driver not in _inplace._drivers
    for mode in ("0", "1", "stream"):
        monkeypatch.setenv("DOS_TORCH_CLIP_SCALED", mode)
        assert _inplace.clip_mode(object()) == mode
        assert _inplace.clip_mode(None) == mode
