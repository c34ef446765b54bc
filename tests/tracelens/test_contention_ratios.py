"""benchmarks/contention_ratios.py: the coverage arithmetic by hand, and the steadiest finding it reports pinned
(docs/whatif.md, "Contention, measured"): dense GEMMs beside a reduce-scatter run 1.57-1.80x their uncovered twins."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._benchmarks import load_benchmark

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CR = load_benchmark("contention_ratios")


def test_covered_length_by_hand():
    u = CR._union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    assert u == [(0.0, 3.0), (5.0, 6.0)]
    starts = [a for a, _ in u]
    assert CR._covered(2.0, 5.5, u, starts) == pytest.approx(1.5)  # 2-3 and 5-5.5
    assert CR._covered(3.0, 5.0, u, starts) == 0.0
    assert CR._covered(-1.0, 10.0, u, starts) == pytest.approx(4.0)


def test_families_and_kinds_by_name():
    assert CR.family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "aten::mm") == "dense GEMM"
    assert CR.family("_ZN7cutlass13device_kernelI...GemmUniversal", "aten::_grouped_mm") == "grouped GEMM"
    assert CR.family("void at::native::vectorized_gather_kernel<16, long>", "aten::index") == "gather/index"
    assert CR.family("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
                     "aten::add_") == "elementwise"
    assert CR.coll_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == "ReduceScatter"
    assert CR.coll_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "SendRecv"


@pytest.mark.parametrize("run", ["h100_scaling/dp2_prof", "h100_4gpu_layouts/dp4_mbs16"])
def test_dense_gemms_beside_a_reduce_scatter_run_slower(run):
    res = CR.measure(FIX / run, 0.5)
    s = [x for x in res["families"]["dense GEMM"]["samples"] if x["kind"] == "ReduceScatter"]
    assert len(s) >= 20
    r = sum(x["ratio"] * x["alone_us"] for x in s) / sum(x["alone_us"] for x in s)
    assert 1.57 <= r <= 1.80, r
