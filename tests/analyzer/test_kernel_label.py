"""How a report names a kernel on one line: no return type, no parameter list, template arguments kept."""

from __future__ import annotations

import pytest

from analyzer.traces.names import kernel_label


@pytest.mark.parametrize("name, label", [
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>"
     "(at::native::(anonymous namespace)::OpaqueType<4>*, int)",
     "at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
     "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"),
    ("ampere_sgemm_64x64_nn", "ampere_sgemm_64x64_nn"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}> >(int, F)",
     "at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}> >"),
    ("Foo::operator()(int)", "Foo::operator()"),
    ("(x)", "(x)"),  # a name that is all parameter list stays whole
    ("voidkernel", "voidkernel"),
])
def test_kernel_label(name, label):
    assert kernel_label(name) == label
