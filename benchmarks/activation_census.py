"""The bytes autograd keeps for the backward, counted on the trainer's own model, against the memory projection.

The memory projection (`tracelens.analysis.memory.layer_activations`) is arithmetic read from the model's code;
this script is its independent truth: it builds the trainer's `Transformer` on the CPU, runs one forward under
`torch.autograd.graph.saved_tensors_hooks` and sums, per layer, the storages autograd saves (each storage once,
parameters excluded), then prints the projection's figure for the same config beside it.

* ``dtype: bf16`` with FSDP (the GPU runs): the parameters are cast to bf16, as FSDP2's ``param_dtype`` does;
  with DDP the forward runs under ``torch.autocast`` like the trainer's.
* ``compile: dense``: the trainer's `compile_dense` (each block's attention half, the dense blocks and the shared
  experts); ``--compile-backend aot_eager_decomp_partition`` takes Inductor's decompositions and its min-cut
  partitioner (which decides what a compiled region saves) without generating C++ (seconds instead of minutes).
* Attention: the CPU's SDPA is the math path, which saves the attention matrix; the GPU's flash / memory-efficient
  kernels save their inputs, output and the fp32 log-sum-exp. The census runs a stand-in with the GPU kernels'
  saved set (`_FlashLike`), so its figure is the GPU's.
* Expert parallelism (``--set ep=2``): one gloo process per rank (spawned), the census of every rank, the largest
  per layer; the dispatch paths' buffers (`tracelens.analysis.memory.index_copy_send`, `combine_saved`) are counted
  as the ranks keep them.
* ``--small``: the config's structure (layers, experts, top-k, attention type, knobs) at small widths, so a check
  runs in seconds; the projection is per token and per width, so the comparison holds at any size.

    python benchmarks/activation_census.py --small --set expert_swiglu=torch --set use_triton_kernels=false
    TRITON_INTERPRET=1 python benchmarks/activation_census.py --small      # the Triton kernels, interpreted (minutes)
    python benchmarks/activation_census.py --small --compile-backend aot_eager_decomp_partition \
        --set expert_swiglu=torch --set use_triton_kernels=false --set ep=2 --set ep_dispatch=capacity
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# widths for --small (the structure -- layers, experts, top-k, attention type, knobs -- stays the config's)
SMALL = {"d_model": 64, "n_heads": 2, "n_kv_heads": 2, "kv_lora_rank": 32, "q_lora_rank": None,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": None, "d_ff": 160,
         "moe_d_ff": 48, "n_routed_experts": 8, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 2,
         "loss_chunk_size": 64}


_SDPA = None


def _flash_like():
    """A causal SDPA that keeps what the GPU's flash / memory-efficient kernels keep: q, k, v, the output and the
    fp32 log-sum-exp per query (the backward recomputes the probabilities). A custom op, so a compiled region sees
    it as one opaque kernel, as it sees the GPU's, instead of partitioning its insides."""
    global _SDPA
    if _SDPA is not None:
        return _SDPA
    import torch

    def _scores(q, k):
        n = q.shape[-2]
        s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
        return s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))

    @torch.library.custom_op("tracelens_census::flash_like", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
    def flash_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = _scores(q, k)
        lse = torch.logsumexp(s, -1)
        return ((s - lse[..., None]).exp() @ v.float()).to(q.dtype), lse

    @flash_like.register_fake
    def _(q, k, v):
        return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.custom_op("tracelens_census::flash_like_bwd", mutates_args=(),
                             schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse) -> (Tensor, Tensor, Tensor)")
    def flash_like_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = 1 / math.sqrt(q.shape[-1])
        p = (_scores(q, k) - lse[..., None]).exp()
        dof = do.float()
        dv = p.transpose(-1, -2) @ dof
        ds = p * (dof @ v.float().transpose(-1, -2) - (dof * o.float()).sum(-1, keepdim=True))
        return ((ds @ k.float()) * scale).to(q.dtype), ((ds.transpose(-1, -2) @ q.float()) * scale).to(k.dtype), \
            dv.to(v.dtype)

    @flash_like_bwd.register_fake
    def _(do, q, k, v, o, lse):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, do, dlse):
        return flash_like_bwd(do, *ctx.saved_tensors)

    flash_like.register_autograd(backward, setup_context=setup_context)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        assert attn_mask is None and dropout_p == 0.0 and is_causal and not kw, "the trainer's SDPA call changed"
        return flash_like(q, k, v)[0]

    _SDPA = sdpa
    return sdpa


def census(cfg: dict, compile_backend: str = "inductor", ep_group=None, ep_rank: int = 0) -> dict:
    """Saved bytes per layer (``layer<i>``), before the layers (``embed``) and after them (``head``) for one
    micro-batch of ``cfg`` on the CPU, and the tokens of that micro-batch. Under expert parallelism (``cfg["ep"]``
    > 1) this is one rank of an initialised gloo group (`ep_census` runs them all); each rank's tokens differ."""
    import torch

    from trainer.model import layers as L
    from trainer.model.transformer import Block, Transformer

    torch.manual_seed(0)
    real_sdpa = L.F.scaled_dot_product_attention  # torch.nn.functional's: put back below
    L.F.scaled_dot_product_attention = _flash_like()  # trainer.model.layers calls it through F
    try:
        ep = int(cfg.get("ep") or 1)
        model = Transformer(cfg, ep_group, ep, ep_rank, None)
        model.init_weights(cfg["seed"])
        if cfg["compile"] == "dense":
            import torch._dynamo

            from trainer import compiling

            torch._dynamo.reset()
            real = torch.compile
            # (compiling's torch is the torch module: Module.compile of the shared experts goes through it too)
            compiling.torch.compile = lambda f, **kw: real(f, backend=compile_backend, **{
                k: v for k, v in kw.items() if k != "mode"})
            try:
                compiling.compile_dense(model, cfg, torch.device("cpu"))
            finally:
                compiling.torch.compile = real
        autocast = cfg["dtype"] == "bf16" and cfg["dp_mode"] == "ddp"
        if cfg["dtype"] == "bf16" and not autocast:
            model = model.to(torch.bfloat16)  # FSDP2's param_dtype: bf16 weights in the forward
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        where = ["embed"]
        for b in model.modules():
            if isinstance(b, Block):
                b.register_forward_pre_hook(lambda m, a, i=b.layer_id: where.__setitem__(0, f"layer{i}"))
                b.register_forward_hook(lambda m, a, o: where.__setitem__(0, "head"))
        saved: dict[int, tuple[str, int]] = {}

        def pack(t):
            s = t.untyped_storage()
            p = s.data_ptr()
            if p not in params and p not in saved:
                saved[p] = (where[0], s.nbytes())
            return t

        B, S = cfg["micro_batch_size"], cfg["seq_len"]
        tokens = torch.randint(0, cfg["vocab_size"], (B, S), generator=torch.Generator().manual_seed(ep_rank))
        for _ in range(2):  # the first forward compiles (compile=dense); count the second
            saved.clear()
            where[0] = "embed"
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, aux = model(tokens, tokens)
            (loss + aux).backward()
        out: dict[str, float] = {}
        for part, n in saved.values():
            out[part] = out.get(part, 0) + n
        return {"tokens": B * S, "bytes": out}
    finally:
        L.F.scaled_dot_product_attention = real_sdpa


def _ep_rank(rank: int, world: int, port: int, cfgs: list[dict], compile_backend: str, out_dir: str) -> None:
    """One rank of `ep_census` (a spawned process): a gloo group over the world, the census of each config in turn,
    the bytes to a file."""
    import torch.distributed as dist

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = [census(cfg, compile_backend, dist.group.WORLD, rank) for cfg in cfgs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def ep_census(cfgs: list[dict], compile_backend: str = "inductor") -> list[list[dict]]:
    """`census` on every rank of an ``ep``-rank gloo group (spawned processes, the world = the configs' ``ep``): the
    trainer's EP dispatch paths keep their buffers on each rank. Several configs of one ``ep`` share the processes
    (one start-up). Per config, one result per rank."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = int(cfgs[0]["ep"])
    if any(int(c["ep"]) != world for c in cfgs):
        raise ValueError("ep_census: the configs must share one ep (the world size)")
    with socket.socket() as sock:  # a free port for the group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # the spawned ranks unpickle `_ep_rank` by its module's name: this file as a module of benchmarks/ there, and
    # here the module this code runs in, registered under that name when it was loaded from its path (the tests)
    if __name__ not in sys.modules:
        import types

        mod = types.ModuleType(__name__)
        mod.__dict__.update(globals())
        sys.modules[__name__] = mod
    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path
    if added:  # a spawned process starts from this one's sys.path
        sys.path.insert(0, here)
    try:
        with tempfile.TemporaryDirectory(prefix="census-ep-") as d:
            mp.start_processes(_ep_rank, args=(world, port, cfgs, compile_backend, d), nprocs=world, join=True,
                               start_method="spawn")
            ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        if added:
            sys.path.remove(here)
    return [[ranks[r][i] for r in range(world)] for i in range(len(cfgs))]


def projection(cfg: dict) -> dict[str, float]:
    """The memory projection's saved bytes per layer for one micro-batch of ``cfg`` on one GPU of ``cfg["ep"]``
    (expert parallelism over the whole world: ``world = ep``)."""
    from tracelens.analysis import memory as M

    lay = M.resolve_layout(cfg, world=int(cfg.get("ep") or 1))
    return {f"layer{i}": float(sum(M.layer_activations(cfg, lay, i).values())) for i in range(cfg["n_layers"])}


def compare(cfg: dict, compile_backend: str = "inductor", ep_ranks: list[dict] | None = None) -> list[dict]:
    """Per layer: the census (under EP the largest over the ranks; ``ep_ranks``: `ep_census`' results for ``cfg``,
    else it is run) against the projection."""
    if int(cfg.get("ep") or 1) > 1:
        ranks = ep_ranks or ep_census([cfg], compile_backend)[0]
        c = {"bytes": {k: max(r["bytes"].get(k, 0.0) for r in ranks) for k in ranks[0]["bytes"]}}
    else:
        c = census(cfg, compile_backend)
    proj = projection(cfg)
    return [{"layer": k, "census_bytes": c["bytes"].get(k, 0.0), "projected_bytes": v,
             "ratio": v / c["bytes"][k] if c["bytes"].get(k) else float("nan")} for k, v in proj.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpu_proxy_train")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trainer config override")
    ap.add_argument("--small", action="store_true", help="the config's structure at small widths (seconds)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend for compile=dense (aot_eager_decomp_partition: the same partitioner)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from moespec.config import ConfigError, load_config, parse_override

    try:
        over = dict(SMALL) if a.small else {}
        over.update(dict(parse_override(s) for s in a.set))
        over["device"] = "cpu"
        cfg = load_config(a.config, over)
    except (ConfigError, ValueError) as e:
        print(f"activation_census: {e}", file=sys.stderr)
        return 2
    if cfg["expert_swiglu"] == "triton" or cfg["use_triton_kernels"]:
        from trainer.model.experts import swiglu_problem

        why = swiglu_problem("cpu")
        if why:  # the PyTorch fallbacks keep other tensors than the kernels: the census would not be the GPU's
            print(f"activation_census: {a.config}: expert_swiglu=triton / use_triton_kernels {why}; or count the "
                  "PyTorch paths with --set expert_swiglu=torch --set use_triton_kernels=false", file=sys.stderr)
            return 2
    rows = compare(cfg, a.compile_backend)
    print(f"{a.config} {' '.join(a.set)}{' (small widths)' if a.small else ''}: saved bytes per token, one micro-batch")
    print(f"{'layer':8} {'census':>10} {'projected':>10} {'proj/census':>11}")
    t = cfg["micro_batch_size"] * cfg["seq_len"]
    for r in rows:
        print(f"{r['layer']:8} {r['census_bytes'] / t:10.1f} {r['projected_bytes'] / t:10.1f} {r['ratio']:11.3f}")
    if a.json:
        a.json.write_text(json.dumps({"config": a.config, "set": a.set, "small": a.small, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
