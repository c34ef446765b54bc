"""Compile every Triton kernel of the package for sm_90 (Hopper) without a GPU; print one JSON line per kernel.

Run in a process *without* TRITON_INTERPRET (the kernels must be JITFunctions). Integer arguments get
the specialisations the JIT would give real shapes: stride-1 arguments are constexpr 1, other
strides/sizes and all pointers are 16-divisible. Used by test_compile_sm90.py.
"""
import json
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import grouped_gemm as G, permutation as P, router as R, cross_entropy as C, activation as S

TARGET = GPUTarget("cuda", 90, 32)
NODIV = {"T", "E", "M_BUCKET", "n", "R", "k", "rows", "ignore_index", "s_dw"}

def jitfn(k):
    while not isinstance(k, triton.runtime.jit.JITFunction):
        k = k.fn
    return k

def comp(name, kernel, sig, consts, num_warps=4, num_stages=3):
    fn = jitfn(kernel)
    full = {}
    for a in fn.arg_names:
        full[a] = "constexpr" if a in consts else sig[a]
    t0 = time.time()
    try:
        # what the JIT infers for 16-aligned pointers and 16-divisible ints (K=2048, N=1408, strides, ...)
        div = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a not in consts and (full[a].startswith("*") or (full[a] == "i32" and a not in NODIV))}
        src = ASTSource(fn=fn, signature=full, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                        attrs=div)
        ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = ck.asm.get("ptx", "")
        print(json.dumps({"name": name, "ok": True, "s": round(time.time() - t0, 2), "wgmma": "wgmma" in ptx,
                          "tma": "cp.async.bulk" in ptx, "shared": ck.metadata.shared,
                          "vec128": "ld.global.v4" in ptx}), flush=True)
    except Exception as e:
        print(json.dumps({"name": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}), flush=True)

i32, i64 = "i32", "i64"
which = sys.argv[1:] or ["fwd", "dw", "tma", "perm", "router", "ce", "swiglu"]
if "fwd" in which:
    for dt, kmaj in [("*bf16", False), ("*bf16", True), ("*fp32", False)]:  # fp32 compiles slowly: one layout
        if True:
            sig = dict(x_ptr=dt, w_ptr=dt, out_ptr=dt, offs_ptr="*i32", T=i32, N=i32, K=i32, E=i32, M_BUCKET=i32,
                       sxm=i32, sxk=i32, swe=i32, swk=i32, swn=i32, som=i32, son=i32)
            consts = dict(BLOCK_E=128, IEEE=dt == "*fp32", UPCAST=False, W_KMAJOR=kmaj, BM=128, BN=128, BK=64, GROUP_M=8,
                          sxk=1, son=1, **({"swk": 1} if kmaj else {"swn": 1}))
            comp(f"gmm_fwd {dt} kmajor={kmaj}", G._gmm_fwd_kernel, sig, consts, 8, 4 if dt == "*bf16" else 2)
if "dw" in which:
    for dt in ["*bf16"]:
        for kmaj in [False, True]:
            sig = dict(x_ptr=dt, dy_ptr=dt, dw_ptr=dt, offs_ptr="*i32", T=i32, K=i32, N=i32, E=i32, M_BUCKET=i32,
                       sxm=i32, sxk=i32, sdm=i32, sdn=i32, swe=i32, swk=i32, swn=i32)
            consts = dict(IEEE=False, UPCAST=False, DW_KMAJOR=kmaj, BM=64, BN=128, BK=128, GROUP_K=8, sxk=1, sdn=1,
                          **({"swk": 1} if kmaj else {"swn": 1}))
            comp(f"gmm_dw {dt} kmajor={kmaj}", G._gmm_dw_kernel, sig, consts, 8, 4)
if "tma" in which:
    for kmaj in [False, True]:
        xd = "tensordesc<bf16[128, 64]>"
        wd = "tensordesc<bf16[1, 128, 64]>" if kmaj else "tensordesc<bf16[1, 64, 128]>"
        sig = dict(x_desc=xd, w_desc=wd, out_ptr="*bf16", offs_ptr="*i32", T=i32, N=i32, K=i32, E=i32, M_BUCKET=i32,
                   som=i32, son=i32)
        consts = dict(BLOCK_E=128, UPCAST=False, W_KMAJOR=kmaj, BM=128, BN=128, BK=64, GROUP_M=8, son=1)
        comp(f"gmm_fwd_tma kmajor={kmaj}", G._gmm_fwd_tma_kernel, sig, consts, 8, 4)
if "perm" in which:
    comp("hist", P._hist_kernel, dict(ids_ptr="*i32", hist_ptr="*i32", n=i32, E=i32), dict(BLOCK=256, BLOCK_E=64), 8)
    comp("scatter_idx", P._scatter_idx_kernel, dict(ids_ptr="*i32", base_ptr="*i32", row_map_ptr="*i32",
         sorted_pos_ptr="*i32", n=i32, E=i32), dict(BLOCK=256, BLOCK_E=64), 8)
    comp("gather_rows", P._gather_rows_kernel, dict(src_ptr="*bf16", idx_ptr="*i32", scale_ptr="*fp32", out_ptr="*bf16",
         dot_ptr="*fp32", dot_with_ptr="*bf16", nrows_ptr="*i32", R=i32, D=i32, k=i32, s_src=i32, s_out=i32,
         s_dw=i32), dict(HAS_SCALE=True, COMPUTE_DOT=True, HAS_NROWS=True, BR=16, BD=128))
    comp("combine", P._combine_kernel, dict(y_ptr="*bf16", row_map_ptr="*i32", w_ptr="*fp32", out_ptr="*bf16", T=i32,
         D=i32, s_y=i32, s_out=i32), dict(K=6, HAS_W=True, BT=16, BD=128))
if "router" in which:
    for ng, tg, bias in [(1, 1, False), (8, 3, False), (1, 1, True), (8, 3, True)]:  # bias: router_bias_update_rate
        comp(f"router_fwd groups={ng} bias={bias}", R._router_fwd_kernel, dict(
             logits_ptr="*bf16", bias_ptr="*fp32" if bias else "*bf16", w_ptr="*fp32", ids_ptr="*i32",
             cnt_ptr="*i32", psum_ptr="*fp32", T=i32, E=i32, s_l=i32, scaling="fp32"),
             dict(TOPK=6, SOFTMAX=True, N_GROUPS=ng, TOPK_GROUPS=tg, NORM=True, HAS_BIAS=bias, BT=64, BLOCK_E=64))
    comp("router_bwd", R._router_bwd_kernel, dict(logits_ptr="*bf16", ids_ptr="*i32", gw_ptr="*fp32", gmp_ptr="*fp32",
         dl_ptr="*bf16", T=i32, E=i32, s_l=i32, s_d=i32, scaling="fp32", inv_T="fp32"),
         dict(TOPK=6, SOFTMAX=True, NORM=True, HAS_GW=True, HAS_GMP=True, BT=64, BLOCK_E=64))
if "ce" in which:
    for hs in [False, True]:
        comp(f"ce_chunk scale={hs}", C._ce_chunk_kernel, dict(logits_ptr="*bf16", target_ptr="*i64", loss_ptr="*fp32",
             scale_ptr="*fp32", V=i32, s_l=i32, ignore_index=i32), dict(HAS_GRAD=True, HAS_SCALE=hs, BLOCK_V=4096), 8)
if "swiglu" in which:  # F = 1408 (16-divisible, like every stride here): the GPU's 32 x 128 tiles
    for bound in (False, True):
        comp("swiglu_fwd" + ("_bound" if bound else ""), S._swiglu_fwd_kernel, dict(h_ptr="*bf16", a_ptr="*bf16", R=i32, F=i32,
             s_h=i32, s_a=i32, n_ptr="*i32"), dict(BOUND=bound, BR=32, BF=128), 4)
        comp("swiglu_bwd" + ("_bound" if bound else ""), S._swiglu_bwd_kernel, dict(h_ptr="*bf16", da_ptr="*bf16", dh_ptr="*bf16",
             R=i32, F=i32, s_h=i32, s_da=i32, s_dh=i32, n_ptr="*i32"), dict(BOUND=bound, BR=32, BF=128), 4)
