"""mpicomm.native: the compiled remembered-call check answers as torch's own Python getters do,
for every way a tensor can change in place, refuses wrong arguments, and is loaded only when
built for this torch."""
from __future__ import annotations

import pytest
import torch

from conftest import single_process
from mpicomm import native

pytestmark = single_process


def _python(t, address, nbytes, dtype) -> bool:
    """The check as mpicomm.fastpath writes it in Python (the reference)."""
    return (t.data_ptr() == address and t.nbytes == nbytes and t.dtype is dtype
            and t.is_contiguous() and t.is_cpu and not t.is_neg())


@pytest.fixture(scope="module")
def facts(native_facts):
    module, why = native_facts
    if module is None:
        pytest.skip(why)
    return module


def _meta(t):
    torch.utils.swap_tensors(t, torch.empty(t.numel(), device="meta"))


CHANGES = {  # each changes one remembered tensor in place; "none" keeps it
    "none": lambda t: None,
    "share_memory_": lambda t: t.share_memory_(),
    "resize_ smaller": lambda t: t.resize_(2),
    "set_ other memory": lambda t: t.set_(torch.zeros(4)),
    ".data = int32 view": lambda t: setattr(t, "data", t.view(torch.int32)),
    "as_strided_": lambda t: t.as_strided_((4,), (2,)),  # same address and bytes
    "_set_neg": lambda t: torch._C._set_neg(t, True),
    "swap_tensors neg view": lambda t: torch.utils.swap_tensors(t, torch._neg_view(t.detach())),
    "swap_tensors meta": _meta,
    "requires_grad_": lambda t: t.requires_grad_(),
    "swap_tensors Parameter": lambda t: torch.utils.swap_tensors(
        t, torch.nn.Parameter(t.detach(), requires_grad=False)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_same_answers_as_the_python_reads(facts, change):
    t = torch.arange(8, dtype=torch.float32)[:4]  # room for a stride of 2
    address, nbytes, dtype = t.data_ptr(), t.nbytes, t.dtype
    CHANGES[change](t)
    want = _python(t, address, nbytes, dtype)
    assert facts.same(t, address, nbytes, dtype) is want, (change, want)
    assert want is (change in ("none", "requires_grad_", "swap_tensors Parameter")), change
    other = torch.zeros(8)  # unchanged: same2 answers for the changed one, first or second
    assert facts.same2(t, other, address, other.data_ptr(), nbytes, other.nbytes, dtype) is want
    assert facts.same2(other, t, other.data_ptr(), address, other.nbytes, nbytes, dtype) is want


def test_each_fact_is_compared(facts):
    """Another address, byte count or dtype than the tensor's gives False."""
    t = torch.zeros(4)
    a, n = t.data_ptr(), t.nbytes
    assert facts.same(t, a, n, torch.float32) is True
    assert facts.same(t, a + 4, n, torch.float32) is False
    assert facts.same(t, a, n - 4, torch.float32) is False
    assert facts.same(t, a, n, torch.int32) is False
    assert facts.same2(t, t, a, a, n, n, torch.int32) is False


def test_the_device_is_compared(facts):
    """An empty tensor (address 0, no bytes) swapped for an empty meta one: only is_cpu differs."""
    t = torch.empty(0)
    address = t.data_ptr()
    torch.utils.swap_tensors(t, torch.empty(0, device="meta"))
    assert (t.data_ptr(), t.nbytes, t.dtype, t.is_contiguous(), t.is_neg()) == (
        address, 0, torch.float32, True, False)
    assert _python(t, address, 0, torch.float32) is False
    assert facts.same(t, address, 0, torch.float32) is False


def test_a_tensor_torch_cannot_read_is_not_the_same(facts):
    """A remembered tensor turned sparse (its data pointer raises in torch): False, no error."""
    t = torch.zeros(4)
    address = t.data_ptr()
    torch.utils.swap_tensors(t, torch.zeros(4).to_sparse())
    with pytest.raises(RuntimeError):
        t.data_ptr()
    assert facts.same(t, address, 16, torch.float32) is False


@pytest.mark.parametrize("args,match", [
    ((None, 0, 8, torch.float32), "torch.Tensor"),
    ((torch.zeros(2), "0", 8, torch.float32), "int address"),
    ((torch.zeros(2), 0, 8, "float32"), "torch.dtype"),
    ((torch.zeros(2), 0, 8), "expected 4 arguments, got 3"),
])
def test_wrong_arguments_raise(facts, args, match):
    with pytest.raises(TypeError, match=match):
        facts.same(*args)


def test_load_only_what_was_built_for_this_torch(tmp_path, monkeypatch, native_facts):
    """An empty cache, MPICOMM_NATIVE=0 or a broken file: None (the broken file with a warning)."""
    assert native.load(tmp_path) is None
    path = native.library_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="python -m mpicomm.build_native"):
        assert native.load(tmp_path) is None
    monkeypatch.setenv(native.SWITCH_VAR, "0")
    assert native.load(tmp_path) is None


def test_build_names_a_missing_compiler(tmp_path):
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler 'no-such-c\\+\\+'"):
        native.build(tmp_path, cxx="no-such-c++")
