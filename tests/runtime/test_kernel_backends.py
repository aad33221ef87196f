"""The flash and torch_flash backends' calls, checked on CPU against fakes shaped like the real kernels,
and the AUTO / explicit backend resolution rules."""
import inspect
import logging

import pytest
import torch

from libra_megatron.config import KernelBackendName
from libra_megatron.runtime import kernels
from libra_megatron.runtime.kernels import VarlenBatch, flash_attn as fa_backend, resolve_backend, torch_flash
from libra_megatron.runtime.kernels.torch_ref import torch_bwd, torch_fwd

from . import fake_kernels
from .fake_kernels import CALLS, install_flash_attn

# entries with k_len > q_len (a block at the end of its key prefix), k_len == q_len, one-row entries
Q_LENS, K_LENS = [5, 3, 1, 7], [9, 3, 4, 7]
SCALE = 0.37


def _batch():
    return VarlenBatch.from_lengths(Q_LENS, K_LENS, "cpu")


def _tensors(dtype, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(K_LENS), hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(sum(Q_LENS), hq, d, generator=g).to(dtype)


def _exact(q, k, v, do, batch):
    """The exact backend on fp64 copies: what every fake must reproduce from the arguments it received."""
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    out, lse = torch_fwd(q64, k64, v64, batch, SCALE)
    return (out, lse) + torch_bwd(do64, q64, k64, v64, out, lse, batch, SCALE)


def _close(got, want, dtype):
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    CALLS.clear()
    fa_backend.flash_available.cache_clear()
    yield
    fa_backend.flash_available.cache_clear()


def _assert_common(args, batch, cu_q, cu_k, scale_key, causal_key, dropout_key="dropout_p"):
    assert args[cu_q] is batch.cu_q and args[cu_k] is batch.cu_k and args[cu_q].dtype == torch.int32
    assert args[dropout_key] == 0.0 and args[causal_key] is True and args[scale_key] == pytest.approx(SCALE)


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_backend_calls_each_flash_attn_release_with_its_own_signature(monkeypatch, version, dtype):
    install_flash_attn(monkeypatch, version)
    assert fa_backend.flash_available()
    batch = _batch()
    q, k, v, do = _tensors(dtype)
    out, lse = fa_backend.flash_fwd(q, k, v, batch, SCALE)
    dq, dk, dv = fa_backend.flash_bwd(do, q, k, v, out, lse, batch, SCALE)
    (_, fwd), (_, bwd) = CALLS
    for args in (fwd, bwd):
        _assert_common(args, batch, "cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal")
        assert (args["max_seqlen_q"], args["max_seqlen_k"]) == (max(Q_LENS), max(K_LENS))
        assert args["alibi_slopes"] is None and args["softcap"] == 0.0
    if version.startswith("2.6"):
        assert fwd["window_size"] == (-1, -1) and bwd["window_size"] == (-1, -1)
    else:
        assert (fwd["window_size_left"], fwd["window_size_right"]) == (-1, -1) == (bwd["window_size_left"],
                                                                                   bwd["window_size_right"])
    assert fwd["return_softmax"] is False and fwd["block_table"] is None
    assert bwd["deterministic"] is False and bwd["rng_state"] is None
    assert bwd["softmax_lse"] is lse and bwd["out"] is out and bwd["dout"].is_contiguous()
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for got, want in zip((out, lse, dq, dk, dv), _exact(q, k, v, do, batch)):
        _close(got, want, dtype)


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_mode_reaches_flash_attn_backward(monkeypatch, version, deterministic):
    """Through the backend table's ``bwd`` (what libra_attn and the pools-off path call) to flash-attn's own
    ``deterministic`` argument of every supported release."""
    install_flash_attn(monkeypatch, version)
    batch = _batch()
    q, k, v, do = _tensors(torch.bfloat16)
    out, lse = fa_backend.flash_fwd(q, k, v, batch, SCALE)
    flash = kernels._BACKENDS[KernelBackendName.FLASH]
    flash.bwd(do, q, k, v, out, lse, batch, SCALE, deterministic)
    (_, _), (_, bwd) = CALLS
    assert bwd["deterministic"] is deterministic


def test_torch_flash_refuses_deterministic_backward_unless_torch_is_deterministic(monkeypatch):
    ops = fake_kernels.fake_aten_ops(sorted(fake_kernels.ATEN_SCHEMAS)[-1])
    monkeypatch.setattr(torch_flash, "aten_flash_ops", lambda: ops)
    batch = _batch()
    q, k, v, do = _tensors(torch.bfloat16)
    out, lse = torch_flash.torch_flash_fwd(q, k, v, batch, SCALE)
    saved = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        with pytest.raises(ValueError, match=r"^--deterministic-mode with --libra-kernel-backend torch_flash"):
            torch_flash.torch_flash_bwd(do, q, k, v, out, lse, batch, SCALE, deterministic=True)
        torch.use_deterministic_algorithms(True)  # what Megatron-LM's validate_args does for the flag
        dq, _, _ = torch_flash.torch_flash_bwd(do, q, k, v, out, lse, batch, SCALE, deterministic=True)
    finally:
        torch.use_deterministic_algorithms(saved)
    _close(dq, _exact(q, k, v, do, batch)[2], torch.bfloat16)


def test_custom_op_wrappers_hide_their_parameters_so_signature_sniffing_cannot_work(monkeypatch):
    _, iface = fake_kernels.fake_flash_attn("2.8.3")
    params = inspect.signature(iface._flash_attn_varlen_forward).parameters
    assert "window_size_left" not in params  # what the old kwargs filter relied on


@pytest.mark.parametrize("version", ["2.5.9", "2.9.0", "3.0.0"])
def test_unsupported_flash_attn_release_is_a_clear_error(monkeypatch, version):
    install_flash_attn(monkeypatch, version)
    assert not fa_backend.flash_available()
    with pytest.raises(ValueError, match=r"kernel_backend.*flash-attn .* is not supported"):
        fa_backend.flash_fwd(*_tensors(torch.bfloat16)[:3], _batch(), SCALE)


@pytest.mark.parametrize("torch_version", sorted(fake_kernels.ATEN_SCHEMAS))
@pytest.mark.parametrize("expand_kv", [False, True])
def test_torch_flash_backend_calls_aten_ops_as_their_schemas_read(monkeypatch, torch_version, expand_kv):
    ops = fake_kernels.fake_aten_ops(torch_version)
    monkeypatch.setattr(torch_flash, "aten_flash_ops", lambda: ops)
    batch = _batch()
    q, k, v, do = _tensors(torch.bfloat16)
    out, lse = torch_flash.torch_flash_fwd(q, k, v, batch, SCALE, expand_kv=expand_kv)
    dq, dk, dv = torch_flash.torch_flash_bwd(do, q, k, v, out, lse, batch, SCALE, expand_kv=expand_kv)
    (_, fwd), (_, bwd) = CALLS
    for args in (fwd, bwd):
        _assert_common(args, batch, "cum_seq_q", "cum_seq_k", "scale", "is_causal")
        assert (args["max_q"], args["max_k"]) == (max(Q_LENS), max(K_LENS))
        assert args["key"].shape[1] == (q.shape[1] if expand_kv else k.shape[1])
    assert fwd["return_debug_mask"] is False
    assert bwd["logsumexp"].shape == (q.shape[1], q.shape[0]) and bwd["out"].shape == out.shape
    assert dk.shape == k.shape and dv.shape == v.shape and dk.dtype == k.dtype
    for got, want in zip((out, lse, dq, dk, dv), _exact(q, k, v, do, batch)):
        _close(got, want, torch.bfloat16)


def test_flash_and_torch_flash_fakes_distinguish_bottom_right_from_top_left():
    """The fakes would expose a top-left kernel: the alignments differ on these entries."""
    q, k, v, _ = _tensors(torch.float64)
    batch = _batch()
    br, _ = fake_kernels.dense_varlen(q, k, v, batch.cu_q, batch.cu_k, SCALE, True, bottom_right=True)
    tl, _ = fake_kernels.dense_varlen(q, k, v, batch.cu_q, batch.cu_k, SCALE, True, bottom_right=False)
    assert (br - tl).abs().max() > 1e-3
    torch.testing.assert_close(br, torch_fwd(q, k, v, batch, SCALE)[0])


# ------------------------------------------------------------------ resolution rules
@pytest.fixture
def capabilities(monkeypatch):
    """Faked: flash-attn importable, torch's FlashAttention compiled in, and the GPU's compute capability."""
    state = {"flash": False, "torch_flash": False, "sm": (9, 0)}
    monkeypatch.setattr(kernels, "flash_available", lambda: state["flash"])
    monkeypatch.setattr(kernels, "torch_flash_available", lambda device: state["torch_flash"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["sm"])
    kernels._LOGGED.clear()
    return state


CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("flash, tflash, device, dtype, head_dim, expected", [
    (True, True, CUDA, torch.bfloat16, 128, "flash"),
    (False, True, CUDA, torch.float16, 128, "torch_flash"),
    (False, False, CUDA, torch.bfloat16, 128, "torch"),
    (True, True, CUDA, torch.float32, 128, "torch"),  # fp32 on CUDA: the exact path, never a kernel crash
    (True, True, CUDA, torch.bfloat16, 12, "torch"),  # head dim flash cannot take
    (True, True, torch.device("cpu"), torch.bfloat16, 128, "torch"),
])
def test_auto_picks_flash_then_torch_flash_then_exact(capabilities, flash, tflash, device, dtype, head_dim, expected):
    capabilities.update(flash=flash, torch_flash=tflash)
    assert resolve_backend("auto", device, dtype, head_dim).name.value == expected


@pytest.mark.parametrize("sm", [(7, 5), (7, 0)])
def test_pre_ampere_gpu_never_gets_a_flash_kernel(capabilities, sm):
    """flash-attn 2 and torch's FlashAttention-2 raise on sm < 80: auto must take the exact path there, and an
    explicit flash / torch_flash is a one-line error naming the flag and the GPU."""
    capabilities.update(flash=True, torch_flash=True, sm=sm)
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name.value == "torch"
    for name in ("flash", "torch_flash"):
        with pytest.raises(ValueError, match=rf"= {name} needs an sm80\+ \(Ampere or newer\) GPU, got "
                                             rf"sm{sm[0]}{sm[1]} on cuda:0$"):
            resolve_backend(name, CUDA, torch.bfloat16, 128)
    capabilities.update(sm=(8, 0))
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128).name.value == "flash"


def test_auto_logs_its_choice_once(capabilities, caplog):
    capabilities.update(torch_flash=True)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        for _ in range(3):
            resolve_backend("auto", CUDA, torch.bfloat16, 128)
    lines = [r.getMessage() for r in caplog.records if "auto ->" in r.getMessage()]
    assert len(lines) == 1 and "torch_flash" in lines[0] and "flash_attn" in lines[0]


@pytest.mark.parametrize("name, flash, tflash, device, dtype, pattern", [
    ("flash", True, True, CUDA, torch.float32, r"flash supports fp16/bf16 only"),
    ("flash", False, True, CUDA, torch.bfloat16, r"flash flash_attn .* cannot be imported"),
    ("torch_flash", True, False, CUDA, torch.bfloat16, r"torch_flash this torch build/device has no FlashAttention"),
    ("torch_flash", True, True, torch.device("cpu"), torch.bfloat16, r"torch_flash needs CUDA tensors"),
])
def test_explicit_backend_that_cannot_run_the_call_names_the_flag(capabilities, name, flash, tflash, device, dtype,
                                                                  pattern):
    capabilities.update(flash=flash, torch_flash=tflash)
    with pytest.raises(ValueError, match=r"--libra-kernel-backend \(kernel_backend\) = " + pattern):
        resolve_backend(name, device, dtype, 128)


def test_empty_batch_never_reaches_a_kernel():
    def boom(*args):
        raise AssertionError("kernel called on an empty batch")

    backend = kernels.KernelBackend(KernelBackendName.FLASH, boom, boom, lambda *a: None)
    q = torch.zeros(0, 4, 8, dtype=torch.bfloat16)
    k = torch.zeros(0, 2, 8, dtype=torch.bfloat16)
    batch = VarlenBatch.from_lengths([], [], "cpu")
    out, lse = backend.fwd(q, k, k, batch, SCALE)
    assert out.shape == q.shape and lse.shape == (4, 0)
    assert [t.shape for t in backend.bwd(q, q, k, k, out, lse, batch, SCALE)] == [q.shape, k.shape, k.shape]


def _dense_unmasked(q, k, v, batch):
    """fp64 attention of every entry's queries over all of its keys (no mask), independently of the backends."""
    return fake_kernels.dense_varlen(q.double(), k.double(), v.double(), batch.cu_q, batch.cu_k, SCALE, causal=False)


@pytest.mark.parametrize("backend", ["torch", "flash-2.6.3", "flash-2.7.4.post1", "flash-2.8.3", "torch_flash"])
def test_forward_without_mask_reaches_every_backend(monkeypatch, backend):
    """The split entries' keys before their self-sourced tail precede every query: one call with causal off.
    Each backend passes the flag the way its kernel takes it and matches a dense unmasked reference."""
    batch = _batch()
    dtype = torch.float64 if backend == "torch" else torch.bfloat16
    q, k, v, _ = _tensors(dtype)
    if backend == "torch":
        out, lse = torch_fwd(q, k, v, batch, SCALE, causal=False)
    elif backend.startswith("flash"):
        install_flash_attn(monkeypatch, backend.split("-", 1)[1])
        out, lse = fa_backend.flash_fwd(q, k, v, batch, SCALE, causal=False)
        assert CALLS[-1][1]["causal"] is False
    else:
        ops = fake_kernels.fake_aten_ops(sorted(fake_kernels.ATEN_SCHEMAS)[-1])
        monkeypatch.setattr(torch_flash, "aten_flash_ops", lambda: ops)
        out, lse = torch_flash.torch_flash_fwd(q, k, v, batch, SCALE, causal=False)
        assert CALLS[-1][1]["is_causal"] is False
    want_out, want_lse = _dense_unmasked(q, k, v, batch)
    _close(out, want_out, dtype)
    _close(lse, want_lse, dtype)
    causal_out, _ = torch_fwd(q.double(), k.double(), v.double(), batch, SCALE)
    assert not torch.allclose(causal_out, want_out)  # the flag matters on these entries (k_len > q_len)
