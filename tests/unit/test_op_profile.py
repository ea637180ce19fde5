"""``tools/op_profile.host_share`` on a CPU: the share of a profiled step spent outside ATen's operators."""

from __future__ import annotations

import time

import torch

from tools.op_profile import measure


def _busy_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_host_share_is_the_time_outside_atens_operators():
    cpu = torch.device("cpu")
    a = torch.randn(512, 512)

    def products() -> None:
        for _ in range(20):
            a @ a  # the product is the work

    start = time.perf_counter()
    products()
    took = time.perf_counter() - start

    def python_between() -> None:
        products()
        _busy_python(3 * took)  # three quarters of the step outside any operator

    kernels, host = measure(products, cpu).host_share, measure(python_between, cpu).host_share
    assert kernels < 0.3 and 0.6 < host < 0.9, (kernels, host)
