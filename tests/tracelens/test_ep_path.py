"""The EP dispatch path's own kernels (tracelens/projection/ep_path.py) and their insertion from a run at ep 1
(mechanisms/layout.py `insert_ep_path`), checked against the 4 x H100 grid's measured kernels."""

from pathlib import Path

import pytest

from tracelens.projection import ep_path as EP
from tracelens.projection.mechanisms import layout as L
from tracelens.projection.whatif import Model

ROOT = Path(__file__).resolve().parents[2]
DP4 = ROOT / "tests" / "fixtures" / "h100_4gpu_layouts" / "dp4_mbs16"
EP4 = ROOT / "tests" / "fixtures" / "h100_4gpu_layouts" / "ep4_cap_mbs16"
CFG = {"ep": 4, "top_k": 6, "n_routed_experts": 64, "d_model": 2048, "ep_dispatch": "capacity",
       "ep_capacity_factor": 1.25, "sync_free_level": 3, "ep_overlap": False}


def test_each_path_moves_its_buffer_as_the_trainer_does():
    T, R, B, D = 32768, 196608, 245760, 2048
    cap = EP.kernels("capacity", T, R, B, D, 2)
    # 15 per chunk: 3 fills, 2 copies, 2 index_copy, 4 regroup gathers of B rows, 2 gathers of R rows, 2 where
    names = sorted(k.name for k in cap)
    assert names.count("fill") == 3 and names.count("copy") == 2 and names.count("index_copy") == 2
    assert names.count("gather") == 6 and names.count("where") == 2
    assert sum(k.amount for k in cap if k.name == "gather" and k.amount == 2 * B * D * 2) == 4 * 2 * B * D * 2
    assert all(k.generic for k in cap if k.name in ("where", "index_copy"))
    nccl = EP.kernels("nccl_l3", T, R, 786432, D, 2)
    assert len(nccl) == 11 and not any(k.name == "where" for k in nccl)
    assert EP.kernels("symm", T, R, B, D, 2) == []
    assert EP.path_name(CFG) == "capacity" and EP.path_name({**CFG, "ep_dispatch": "nccl"}) == "nccl_l3"
    assert EP.path_name({**CFG, "ep_dispatch": "nccl", "sync_free_level": 1}) == "nccl_exact"
    assert EP.path_name({**CFG, "ep_capacity_fused": True}) == "capacity_fused"


@pytest.fixture(scope="module")
def dp4():
    return Model.from_run(DP4)


def test_rates_come_from_the_runs_own_kernels_and_predict_the_ep_runs_kernels(dp4):
    """The dp 4 run's permute gather (2.9 TB/s) and generic elementwise kernels (~294 G elements/s) give the EP path's
    kernels of the ep 4 capacity run: each family within 25 % (the half-size and small kernels run a little off the
    rate), all of them within 10 % (measured: the ep 4 fixture's own kernels of the same ops in its dispatch, permute
    and combine ranges, over 50 µs, summed over its step; the loader's durations, which test_loader holds to the raw
    JSON)."""
    r = EP.measure_rates(dp4.profiles, 2)
    assert r is not None and 2500 < r.bytes_per_ns < 3300 and 250 < r.elems_per_ns < 340
    T, R, B = L.ep_chunk_shape(CFG, 32768)
    assert (T, R, B) == (32768, 196608, 245760)
    pred: dict = {}
    for k in EP.kernels("capacity", T, R, B, 2048, 2):
        pred[k.name] = pred.get(k.name, 0.0) + 3 * EP.seconds(k, r)  # 3 MoE layers
    ep4 = Model.from_run(EP4)
    p = ep4.profiles[0]
    w = p.work
    fam = {"aten::fill_": "fill", "aten::copy_": "copy", "aten::gather": "gather", "aten::index_copy": "index_copy",
           "aten::index_copy_": "index_copy", "aten::where": "where"}
    st = w["moe_stage"].astype(str)
    sel = st.isin(["moe/dispatch", "moe/permute", "moe/combine"]) & ~w["is_comm"] & (w["dur"] > 50_000)
    meas: dict = {}
    for op, d in zip(w.loc[sel, "op"], w.loc[sel, "dur"]):
        if op in fam:
            meas[fam[op]] = meas.get(fam[op], 0.0) + float(d)
    for f in ("fill", "copy", "index_copy", "gather", "where"):
        assert pred[f] == pytest.approx(meas[f], rel=0.25), (f, pred[f], meas[f])
    assert sum(pred.values()) == pytest.approx(sum(meas.values()), rel=0.10)


def test_dp_to_ep_adds_the_path_on_its_own_stream_and_says_so(dp4):
    p = dp4.predict({"ep": 4, "ep_dispatch": "capacity"})
    text = "\n".join(p.modeled)
    assert "EP dispatch path (capacity" in text and "15 kernels per MoE layer" in text
    assert "on a stream of their own" in text and "the fastest of the run's collectives over 4" in text
    assert "FSDP of the experts, copies" in text
    assert not any("regroup kernels of an EP run are not in a DP run's trace" in n for n in p.notes)
