"""Perf models for convolution, batch / group norm, the remaining SDPA entry points and out= variants.

Every expected FLOP and byte count is worked out by hand in the test from the shapes (the convolution
output size from the textbook formula, FLOPs = 2 per multiply-add), never by calling the model twice.
"""

from __future__ import annotations

import json

import pytest

import tracelens
from tracelens import perfmodels as P
from tracelens.analysis import roofline as R
from tracelens.perfmodels import model_args

BF, F32 = "c10::BFloat16", "float"


def perf(name, dims, types, concrete=None, strides=None):
    r = model_args(name, dims, types, concrete or [""] * len(dims), strides)
    assert r.perf is not None, r.reason
    return r.perf


def reason(name, dims, types, concrete=None):
    r = model_args(name, dims, types, concrete or [""] * len(dims))
    assert r.perf is None
    return r.reason


# ------------------------------------------------------------------------------ convolution


def test_conv2d_with_bias():
    # [2, 3, 32, 32] * [16, 3, 3, 3], stride 1, padding 1 -> [2, 16, 32, 32]
    p = perf("aten::conv2d", [[2, 3, 32, 32], [16, 3, 3, 3], [16], [], [], [], []],
             [BF, BF, BF, "ScalarList", "ScalarList", "ScalarList", "Scalar"], ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "1"])
    assert p.flops == 2 * 2 * 16 * 32 * 32 * 3 * 3 * 3  # 1,769,472
    assert p.bytes == 2 * (2 * 3 * 32 * 32 + 16 * 3 * 3 * 3 + 16 + 2 * 16 * 32 * 32)
    assert p.kind == "conv" and p.matrix and p.dtype == "bf16"


def test_convolution_family_agrees_on_one_call():
    """conv2d -> convolution -> _convolution -> cudnn_convolution as the H100 fixtures record them
    (cudnn_convolution has no bias and takes padding before stride): 7x7 stride 2 padding 3."""
    inp, w = [1, 3, 224, 224], [64, 3, 7, 7]
    want = 2 * 64 * 112 * 112 * 3 * 7 * 7  # output 112 x 112
    assert (224 + 2 * 3 - 7) // 2 + 1 == 112
    calls = {
        "aten::conv2d": ([inp, w, [], [], [], [], []], [BF, BF, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"],
                         ["", "", "", "[2, 2]", "[3, 3]", "[1, 1]", "1"]),
        "aten::convolution": ([inp, w] + [[]] * 7, [BF, BF, "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar"],
                              ["", "", "", "[2, 2]", "[3, 3]", "[1, 1]", "False", "[0, 0]", "1"]),
        "aten::_convolution": ([inp, w] + [[]] * 11, [BF, BF, "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList",
                                                      "Scalar", "Scalar", "Scalar", "Scalar", "Scalar"],
                               ["", "", "", "[2, 2]", "[3, 3]", "[1, 1]", "False", "[0, 0]", "1", "False", "False", "True", "True"]),
        "aten::cudnn_convolution": ([inp, w] + [[]] * 7, [BF, BF, "ScalarList", "ScalarList", "ScalarList", "Scalar", "Scalar", "Scalar", "Scalar"],
                                    ["", "", "[3, 3]", "[2, 2]", "[1, 1]", "1", "False", "False", "True"]),
        "aten::miopen_convolution": ([inp, w] + [[]] * 7, [BF, BF, "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "Scalar", "Scalar"],
                                     ["", "", "", "[3, 3]", "[2, 2]", "[1, 1]", "1", "False", "False"]),
    }
    for name, (d, t, c) in calls.items():
        p = perf(name, d, t, c)
        assert p.flops == want, name
        assert p.bytes == 2 * (3 * 224 * 224 + 64 * 3 * 49 + 64 * 112 * 112), name


def test_miopen_convolution_from_the_mi300_fixture():
    # [10, 256, 14, 14] * [512, 256, 3, 3], padding 1, stride 2 -> [10, 512, 7, 7]
    p = perf("aten::miopen_convolution", [[10, 256, 14, 14], [512, 256, 3, 3], [], [], [], [], [], [], []],
             [BF, BF, "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "Scalar", "Scalar"],
             ["", "", "", "[1, 1]", "[2, 2]", "[1, 1]", "1", "False", "False"])
    assert p.flops == 2 * 10 * 512 * 7 * 7 * 256 * 9 == 1_156_055_040


def test_depthwise_strided_dilated_and_1d_same():
    # depthwise: 32 groups of one channel, 3x3, no padding: 10 -> 8
    p = perf("aten::conv2d", [[1, 32, 10, 10], [32, 1, 3, 3], [], [], [], [], []],
             [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"], ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "32"])
    assert p.flops == 2 * 32 * 8 * 8 * 9
    # stride 2, dilation 2, 3x3 on 10x10: (10 - 2*2 - 1) // 2 + 1 = 3
    p = perf("aten::conv2d", [[1, 1, 10, 10], [1, 1, 3, 3], [], [], [], [], []],
             [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"], ["", "", "", "[2, 2]", "[0, 0]", "[2, 2]", "1"])
    assert p.flops == 2 * 3 * 3 * 9
    # conv1d.padding with padding='same': output length = input length
    p = perf("aten::conv1d", [[4, 16, 100], [32, 16, 5], [], [], [], [], []],
             [F32, F32, "", "ScalarList", "str", "ScalarList", "Scalar"], ["", "", "", "[1]", "'same'", "[1]", "1"])
    assert p.flops == 2 * 4 * 32 * 100 * 16 * 5
    # unbatched input [C, H, W]
    p = perf("aten::conv2d", [[3, 8, 8], [4, 3, 1, 1], [], [], [], [], []],
             [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"], ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "1"])
    assert p.flops == 2 * 4 * 64 * 3


def test_transposed_convolution():
    # weight [C_in=8, C_out=4, 2, 2], stride 2: 5x5 -> (5-1)*2 + (2-1) + 1 = 10x10; every input position
    # meets every weight element once: 2 * numel(weight) * input positions
    p = perf("aten::convolution", [[1, 8, 5, 5], [8, 4, 2, 2]] + [[]] * 7,
             [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar"],
             ["", "", "", "[2, 2]", "[0, 0]", "[1, 1]", "True", "[0, 0]", "1"])
    assert p.flops == 2 * 8 * 4 * 2 * 2 * 5 * 5 == 2 * (4 * 10 * 10) * 8  # = per output: 8 taps on average
    assert p.bytes == 4 * (8 * 25 + 8 * 4 * 4 + 4 * 100)


def test_convolution_backward_per_output_mask():
    go, x, w = [10, 128, 28, 28], [10, 128, 28, 28], [128, 128, 3, 3]
    types = [BF, BF, BF, "ScalarList", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar", "ScalarList"]
    conc = ["", "", "", "[0]", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[True, True, False]"]
    fwd = 2 * 10 * 128 * 28 * 28 * 128 * 9  # 2,312,110,080
    p = perf("aten::convolution_backward", [go, x, w] + [[]] * 8, types, conc)
    assert p.flops == 2 * fwd
    n_go, n_x, n_w = 10 * 128 * 784, 10 * 128 * 784, 128 * 128 * 9
    assert p.bytes == 2 * (n_go + n_w + n_x + n_x + n_w)  # read dY, W, X; write dX, dW
    conc2 = conc[:-1] + ["[False, True, True]"]
    p = perf("aten::convolution_backward", [go, x, w] + [[]] * 8, types, conc2)
    assert p.flops == fwd + n_go  # grad_weight + grad_bias (one add per dY element)
    assert p.bytes == 2 * (n_go + n_x + n_w + 128)


def test_convolution_unmodeled_reasons():
    assert "padding" in reason("aten::conv2d", [[1, 3, 8, 8], [4, 3, 3, 3], [], [], [], [], []],
                               [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"], ["", "", "", "[1, 1]", "", "[1, 1]", "1"])
    assert "valid output" in reason("aten::conv2d", [[1, 5, 8, 8], [4, 3, 3, 3], [], [], [], [], []],
                                    [F32, F32, "", "ScalarList", "ScalarList", "ScalarList", "Scalar"],
                                    ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "1"])  # 5 channels vs 3
    assert "output_mask" in reason("aten::convolution_backward", [[1, 4, 6, 6], [1, 3, 8, 8], [4, 3, 3, 3]] + [[]] * 8,
                                   [F32] * 3 + ["ScalarList"] * 4 + ["Scalar", "ScalarList", "Scalar", "ScalarList"],
                                   ["", "", "", "[0]", "[1, 1]", "[0, 0]", "[1, 1]", "False", "[0, 0]", "1", ""])


# ------------------------------------------------------------------------------ batch / group norm

BN_TYPES = [BF] * 5 + ["Scalar"] * 3


def test_batch_norm_training_and_eval():
    x, c = [10, 512, 7, 7], [512]
    n = 10 * 512 * 49
    p = perf("aten::native_batch_norm", [x, c, c, c, c, [], [], []], BN_TYPES, ["", "", "", "", "", "True", "0.1", "1e-05"])
    assert p.flops == 5 * n
    # x read, y written; weight, bias read; running mean/var read and written; fp32 save_mean/invstd written
    assert p.bytes == 2 * n * 2 + 2 * 512 * 2 + 2 * (2 * 512 * 2) + 2 * 512 * 4
    p = perf("aten::native_batch_norm", [x, c, c, c, c, [], [], []], BN_TYPES, ["", "", "", "", "", "False", "0.1", "1e-05"])
    assert p.flops == 2 * n and p.note == "eval"
    assert p.bytes == 2 * n * 2 + 2 * 512 * 2 + 2 * 512 * 2
    p = perf("aten::_native_batch_norm_legit_no_training", [x, c, c, c, c, [], []], BN_TYPES[:7])
    assert p.flops == 2 * n
    # cudnn / miopen forward: same model
    p = perf("aten::miopen_batch_norm", [x, c, c, c, c, [], [], []], BN_TYPES, ["", "", "", "", "", "True", "0.1", "1e-05"])
    assert p.flops == 5 * n
    assert "training" in reason("aten::native_batch_norm", [x, c, c, c, c, [], [], []], BN_TYPES)


def test_batch_norm_backward():
    x, c = [10, 512, 7, 7], [512]
    n = 10 * 512 * 49
    p = perf("aten::native_batch_norm_backward", [x, x, c, c, c, c, c, [], [], []],
             [BF, BF, BF, BF, BF, F32, F32, "Scalar", "Scalar", "ScalarList"],
             ["", "", "", "", "", "", "", "True", "1e-05", "[True, True, True]"])
    assert p.flops == 8 * n
    reads = 2 * n * 2 + 512 * 2 + 512 * 4 * 2  # dY, X, weight, save_mean, save_invstd (fp32)
    writes = n * 2 + 2 * 512 * 2  # dX, dW, dB
    assert p.bytes == reads + writes
    # cudnn_batch_norm_backward takes input first, grad_output second, and writes all three
    p = perf("aten::cudnn_batch_norm_backward", [x, x, c, c, c, c, c, [], [4]],
             [BF, BF, BF, BF, BF, F32, F32, "Scalar", "unsigned char"])
    assert p.flops == 8 * n and p.bytes == reads + writes


def test_group_norm_forward_backward():
    x = [2, 64, 8, 8]
    n = 2 * 64 * 64
    p = perf("aten::native_group_norm", [x, [64], [64], [], [], [], [], []], [F32, F32, F32] + ["Scalar"] * 5,
             ["", "", "", "2", "64", "64", "8", "1e-05"])
    assert p.flops == 5 * n
    assert p.bytes == 2 * n * 4 + 2 * 64 * 4 + 2 * (2 * 8) * 4  # x, y, weight, bias, fp32 mean + rstd per (n, g)
    p = perf("aten::group_norm", [x, [], [64], [64], [], []], [F32, "Scalar", F32, F32, "Scalar", "Scalar"],
             ["", "8", "", "", "1e-05", "True"])
    assert p.flops == 5 * n and p.bytes == 2 * n * 4 + 2 * 64 * 4
    assert "groups" in reason("aten::group_norm", [x, [], [64], [64], [], []], [F32, "Scalar", F32, F32, "Scalar", "Scalar"],
                              ["", "7", "", "", "1e-05", "True"])
    p = perf("aten::native_group_norm_backward", [x, x, [2, 8], [2, 8], [64], [], [], [], [], []],
             [F32] * 5 + ["Scalar"] * 4 + ["ScalarList"], ["", "", "", "", "", "2", "64", "64", "8", "[True, True, True]"])
    assert p.flops == 8 * n
    assert p.bytes == (n + n + 16 + 16 + 64) * 4 + (n + 64 + 64) * 4


# ------------------------------------------------------------------------------ attention entry points


def test_sdpa_overrideable_and_cpu_backward():
    q = [2, 4, 128, 64]
    p = perf("aten::_scaled_dot_product_fused_attention_overrideable", [q, q, q, [], [], [], [], []],
             [BF, BF, BF, "", "Scalar", "Scalar", "Scalar", ""], ["", "", "", "", "0.", "True", "False", ""])
    pairs = 2 * 4 * (128 * 129 // 2)  # causal: query i sees keys 0..i
    assert p.flops == 2 * pairs * (64 + 64) and p.note == "causal"
    p = perf("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [q, q, q, q, q, [2, 4, 128], [], [], [], []],
             [F32] * 5 + [F32, "Scalar", "Scalar", "", ""], ["", "", "", "", "", "", "0.", "False", "", ""])
    assert p.flops == 2 * (2 * 4 * 128 * 128) * (3 * 64 + 2 * 64)  # recomputed QK^T + four matmuls


def test_efficient_attention_varlen_is_not_guessed():
    q = [1, 300, 8, 64]  # three sequences packed into one: lengths only in cu_seqlens' values
    dims = [q, q, q, [], [4], [4], [], [], [], [], [], [], [], []]
    types = [BF, BF, BF, "", "int", "int", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "", "", ""]
    conc = ["", "", "", "", "", "", "120", "120", "0.", "1", "False", "", "", ""]
    assert "variable-length" in reason("aten::_efficient_attention_forward", dims, types, conc)
    dims[4] = dims[5] = []
    types[4] = types[5] = ""
    p = perf("aten::_efficient_attention_forward", dims, types, conc)
    assert p.flops == 2 * (8 * 300 * 301 // 2) * (64 + 64)  # custom_mask_type 1: causal from the top left


def test_rocm_paged_attention_reason():
    assert not P.has_model("aiter::mha_batch_prefill")
    r = P.model("aiter::mha_batch_prefill", "[[15360, 32, 128], [835874, 8, 128]]", '["c10::BFloat16", "c10::BFloat16"]')
    assert r.perf is None and "per-sequence" in r.reason


# ------------------------------------------------------------------------------ out= variants


def test_out_variants_count_like_their_functional_form():
    m, k, n = 64, 32, 16
    mm = perf("aten::mm", [[m, k], [k, n]], [BF, BF])
    for name in ("aten::mm.out", "aten::mm_out"):
        p = perf(name, [[m, k], [k, n], [m, n]], [BF, BF, BF])  # out= tensor recorded last
        assert (p.flops, p.bytes) == (mm.flops, mm.bytes) == (2 * m * n * k, 2 * (m * k + k * n + m * n))
    add = perf("aten::add", [[1000], [1000], []], [BF, BF, "Scalar"])
    assert (add.flops, add.bytes) == (1000, 2 * 3 * 1000)  # two reads, one write
    for name in ("aten::add.out", "aten::add"):  # named out= variant, and the functional name with out=
        p = perf(name, [[1000], [1000], [], [1000]], [BF, BF, "Scalar", BF])
        assert (p.flops, p.bytes) == (add.flops, add.bytes), name
    # the fixtures' aten::mul recorded with three tensors is mul.out: the third is written, not read
    p = perf("aten::mul", [[8, 1000], [8, 1000], [8, 1000]], [F32, F32, F32])
    assert p.bytes == 4 * 3 * 8000
    p = perf("aten::silu_backward.grad_input", [[100], [100], [100]], [F32, F32, F32])
    assert p.bytes == 4 * 3 * 100 and p.flops == 6 * 100
    assert P.canonical_name("aten::add.Tensor") == ("aten::add", False)
    assert P.canonical_name("aten::add.Scalar_out") == ("aten::add", True)
    assert not P.has_model("torch::distributed::reducer::mul_out")  # not an aten op's out= form
    # max(self, other) is the elementwise maximum, not a reduction
    p = perf("aten::max", [[50], [50]], [F32, F32])
    assert p.kind == "elementwise" and p.bytes == 4 * 150


def _trace(path, outer_kernel: bool):
    """aten::mm (functional) around aten::mm.out, which launches the GEMM; the outer op optionally
    launches a kernel of its own."""
    m, k, n = 256, 128, 64
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100, "dur": 50,
         "args": {"Input Dims": [[m, k], [k, n]], "Input type": [BF, BF], "Concrete Inputs": ["", ""]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm.out", "pid": 1, "tid": 1, "ts": 110, "dur": 20,
         "args": {"Input Dims": [[m, k], [k, n], [m, n]], "Input type": [BF, BF, BF], "Concrete Inputs": ["", "", ""]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 115, "dur": 2,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 1000, "dur": 8,
         "args": {"correlation": 1, "device": 0, "stream": 7}},
    ]
    if outer_kernel:
        ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 140, "dur": 2,
                "args": {"correlation": 2}},
               {"ph": "X", "cat": "kernel", "name": "fill_kernel", "pid": 0, "tid": 7, "ts": 1010, "dur": 3,
                "args": {"correlation": 2, "device": 0, "stream": 7}}]
    path.write_text(json.dumps({"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]}))
    return path, 2 * m * n * k


@pytest.mark.parametrize("outer_kernel", [False, True])
def test_functional_parent_and_out_variant_count_once(tmp_path, outer_kernel):
    path, flops = _trace(tmp_path / "t.json", outer_kernel)
    r = R.roofline_result(tracelens.analyze(tracelens.load(path, cache=False), window="all"))
    assert r.table["total_flops"].sum() == flops  # the GEMM once, not once per nesting level
    assert r.table["op"].tolist() == ["aten::mm.out"] and r.table["gpu_us"].sum() == pytest.approx(8.0)
    if outer_kernel:  # the parent's own kernel cannot be given the parent's FLOPs: listed, not modeled
        um = r.unmodeled.set_index("op")
        assert um.loc["aten::mm", "reason"] == R.NESTED_REASON and um.loc["aten::mm", "gpu_us"] == pytest.approx(3.0)
