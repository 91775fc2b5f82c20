"""Workloads: loaders, refusals, and micro-batch counts against a loop reference."""

import json
import re

import numpy as np
import pytest

from feplb.traces import (
    ExpertShape,
    MultinomialWorkload,
    RoutingTrace,
    SyntheticWorkload,
    load_trace,
    load_workload,
    shape_for,
    trace_counts,
)


def _counts_ref(ids_WSLK, E):
    W, S, L, K = ids_WSLK.shape
    out = np.zeros((L, W, E), dtype=np.int64)
    for w in range(W):
        for s in range(S):
            for layer in range(L):
                for k in range(K):
                    out[layer, w, ids_WSLK[w, s, layer, k]] += 1
    return out


def test_trace_counts_matches_loops():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 12, size=(3, 5, 2, 4)).astype(np.uint8)
    assert np.array_equal(trace_counts(ids, 12), _counts_ref(ids, 12))


def test_microbatches_are_sample_aligned_slices(tmp_path):
    rng = np.random.default_rng(1)
    T, L, K, E = 50, 2, 3, 16
    ids = rng.integers(0, E, size=(T, L, K)).astype(np.int16)
    offsets = np.array([0, 7, 20, 33, 50])
    path = tmp_path / "t.npz"
    np.savez(path, topk_ids=ids, seq_offsets=offsets, topk_weights_e4=np.full((T, L, K), 2500, np.uint16))
    trace = load_trace(path)
    assert trace.num_experts == int(ids.max()) + 1 and trace.topk_weights_TLK[0, 0, 0] == np.float32(0.25)
    W, S = 3, 9
    got = trace.microbatches(np.random.default_rng(5), W, S)
    ref_rng = np.random.default_rng(5)
    for _ in range(3):
        first = offsets[:-1][ref_rng.integers(0, 4, size=W)]
        idx = (first[:, None] + np.arange(S)) % T  # wraps around the end of the trace
        assert np.array_equal(next(got), _counts_ref(ids[idx], trace.num_experts))


def test_flame_layout(flame_path):
    trace = load_trace(flame_path)
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (2048, 8, 6, 64)
    assert trace.layer_names == tuple(str(i) for i in range(2, 10))
    c = next(trace.microbatches(np.random.default_rng(0), 4, 100))
    assert c.shape == (8, 4, 64) and np.all(c.sum(axis=2) == 600)


@pytest.mark.parametrize(
    "arrays, match, exc",
    [
        ({"topk_ids": np.zeros((4, 2, 2), np.float32)}, "integer dtype, got float32", TypeError),
        ({"topk_ids": np.zeros((4, 2), np.int64)}, r"shape \[T, L, K\], got \[4, 2\]", ValueError),
        ({"topk_ids": np.full((4, 2, 2), -1, np.int8)}, "must be >= 0, got -1", ValueError),
        ({"topk_ids": np.full((4, 2, 2), 64, np.int64)}, "expert id 64 >= num_experts=64", ValueError),
        ({"ids": np.zeros((4, 2, 2), np.int64)}, "no 'topk_ids' or 'prefill_topk_ids'", ValueError),
        ({"topk_ids": np.zeros((4, 2, 2), np.int64), "seq_offsets": np.array([0, 3])}, "seq_offsets must rise",
         ValueError),
        # unsigned offsets that fall (np.diff wraps a fall into a huge rise), or one past int64 (the cast wraps it)
        ({"topk_ids": np.zeros((4, 2, 2), np.int64), "seq_offsets": np.array([0, 3, 2, 4], np.uint32)},
         "seq_offsets must rise", ValueError),
        ({"topk_ids": np.zeros((4, 2, 2), np.int64), "seq_offsets": np.array([0, 2**64 - 1, 4], np.uint64)},
         "seq_offsets must rise", ValueError),
        ({"topk_ids": np.zeros((4, 2, 2), np.int64), "topk_weights": np.zeros((4, 2))}, "gate weights must have",
         ValueError),
        ({"topk_ids": np.zeros((4, 2, 2), np.int64), "topk_weights": np.full((4, 2, 2), "a")},
         "topk_weights must hold real numbers, got <U1", ValueError),
        ({"prefill_topk_ids": np.zeros((4, 2, 2), np.int64), "prefill_topk_scores": np.ones((4, 2, 2), np.complex64)},
         "prefill_topk_scores must hold real numbers, got complex64", ValueError),
    ],
    ids=["float-ids", "2d-ids", "negative-id", "id-too-large", "no-ids", "bad-offsets", "falling-unsigned-offsets",
         "unsigned-offset-past-int64", "bad-weights", "text-weights", "complex-scores"],
)
def test_bad_trace_files(tmp_path, arrays, match, exc):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(exc, match=match):
        load_trace(path, num_experts=64)


def test_missing_file_and_bad_spec(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "nope.npz")
    with pytest.raises(ValueError, match="unknown trace spec"):
        load_workload("trace.csv")
    with pytest.raises(ValueError, match="bad option 'Q=3'"):
        load_workload("synthetic:zipf:Q=3")
    with pytest.raises(ValueError, match="'zipf' or 'dirichlet'"):
        load_workload("synthetic:uniform")
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        load_workload("synthetic:zipf:E=8:K=9")
    # an option given twice: the last value was taken silently (E=16 simulated as E=8)
    with pytest.raises(ValueError, match="'synthetic:zipf:E=16:K=2:E=8': option E is given twice"):
        load_workload("synthetic:zipf:E=16:K=2:E=8")
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"models": {"a": {"top_k": 1, "topk": {"d": [[1, 1]]}}}}))
    with pytest.raises(ValueError, match="option model is given twice"):
        load_workload(f"{path}:model=a:model=b")


def test_olmoe_domains_per_rank(tmp_path):
    doc = {"layers": [0, 7], "models": {"m": {"top_k": 2, "topk": {
        "a": [[10, 0, 0, 0], [0, 5, 0, 0]],
        "b": [[0, 0, 3, 0], [0, 0, 0, 1]]}}}}
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(doc))
    w = load_workload(f"{path}:model=m:domains=a,b")
    assert isinstance(w, MultinomialWorkload) and (w.num_experts, w.top_k, w.layer_names) == (4, 2, ("L0", "L7"))
    c = next(w.microbatches(np.random.default_rng(0), 4, 10))
    # ranks 0 and 2 draw from domain a, ranks 1 and 3 from domain b; 10 tokens x top-2 = 20 rows each
    assert c[0, :, 0].tolist() == [20, 0, 20, 0] and c[0, :, 2].tolist() == [0, 20, 0, 20]
    assert c[1, :, 1].tolist() == [20, 0, 20, 0] and c[1, :, 3].tolist() == [0, 20, 0, 20]
    with pytest.raises(ValueError, match="unknown domains"):
        load_workload(f"{path}:model=m:domains=a,zz")
    with pytest.raises(ValueError, match="unknown model"):
        load_workload(f"{path}:model=x")
    # a model or variant entry of another JSON type is named as such (a string model entry passed the 'in' test
    # as a substring and failed in indexing; a list was called an unknown variant, a list of domains 'unknown')
    for entry, match in (("xtopkx", r"models.m must be an object .* got a str"),
                         ([1], r"models.m must be an object .* got a list"),
                         ({"top_k": 2, "topk": [[1, 2]]}, r"models.m.topk must map each domain .* got a list")):
        path.write_text(json.dumps({**doc, "models": {"m": entry}}))
        with pytest.raises(ValueError, match=match):
            load_workload(f"{path}:model=m")
    # counts that are not numbers: strings were parsed ("1", " 3 ", "4e0"), true read as 1
    for counts, got in (([[1, 0, 0, 0], [0, " 3 ", 0, "4e0"]], "' 3 '"), ([[1, True, 0, 0], [0, 1, 0, 0]], "True"),
                        ([[0, 1, 0, 0], [0, 1, 0, None]], "None"), ([[0, 1, 0, 0], [0, 1, 0, {}]], "{}")):
        path.write_text(json.dumps({**doc, "models": {"m": {"top_k": 2, "topk": {"a": counts}}}}))
        with pytest.raises(ValueError, match=f"must be numbers in a .* got {re.escape(got)}$"):
            load_workload(f"{path}:model=m")
    for models in (["m"], "xmx"):   # (the container itself: a list or a string passed the `in` test)
        path.write_text(json.dumps({**doc, "models": models}))
        with pytest.raises(ValueError, match=r"'models' must be an object mapping model names .* got a (list|str)"):
            load_workload(f"{path}:model=m")


def test_synthetic_is_seeded_and_drifts():
    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=2, drift=0.5, seed=3)
    a = w.microbatches(np.random.default_rng(0), 4, 64)
    b = w.microbatches(np.random.default_rng(0), 4, 64)
    first = [next(a) for _ in range(3)]
    assert all(np.array_equal(x, next(b)) for x in first)
    assert all(np.all(x.sum(axis=2) == 256) for x in first)
    # Zipf: the expected share of the most popular expert is far above 1 / E
    big = next(SyntheticWorkload(num_experts=32, top_k=4, num_layers=1, drift=0.0).microbatches(
        np.random.default_rng(0), 1, 4096))
    assert big.max() > 4 * big.mean()


def test_synthetic_refuses_popularities_past_any_meaning():
    """alpha and drift are bounded (a drift of 1e308 overflowed the walk into NaN probabilities mid-run); the bounds
    themselves still draw valid micro-batches."""
    for kw, match in (({"drift": 1e308}, r"drift must be in \[0, 1e6\], got 1e\+308"),
                      ({"drift": float("nan")}, "drift must be in"), ({"drift": -1.0}, "drift must be in"),
                      ({"alpha": 1e7}, r"alpha must be in \(0, 1e6\], got 10000000"), ({"alpha": 0.0}, "alpha")):
        with pytest.raises(ValueError, match=match):
            SyntheticWorkload(num_experts=8, top_k=2, **kw)
    for kind in ("zipf", "dirichlet"):
        gen = SyntheticWorkload(kind=kind, num_experts=8, top_k=2, drift=1e6, alpha=1e6).microbatches(
            np.random.default_rng(0), 2, 16)
        assert all(np.all(next(gen).sum(axis=2) == 32) for _ in range(5))


def test_routing_trace_validates_directly():
    with pytest.raises(ValueError, match="top-k K=5 exceeds num_experts=4"):
        RoutingTrace(name="x", topk_ids_TLK=np.zeros((3, 1, 5), np.int64), num_experts=4)


def test_traces_carry_their_models_expert_shape(tmp_path, flame_path):
    assert load_trace(flame_path).expert_shape.as_dict()["hidden"] == 1024  # FLAME-MoE-290M: H=1024, F=704
    assert (load_trace(flame_path).expert_shape.ffn, shape_for("esft_vanilla_lite_law").ffn) == (704, 1408)
    assert shape_for("olmoe-sft").model == "OLMoE-1B-7B" and shape_for("mistral").hidden == 4096
    assert shape_for("esft_other") is None and shape_for("olmoex") is None
    assert SyntheticWorkload(num_experts=8, top_k=2).expert_shape is None
    ids = np.tile(np.array([0, 1], dtype=np.uint8), (4, 1, 1))
    np.savez(tmp_path / "mine.npz", topk_ids=ids, expert_hidden=np.int64(512), expert_ffn=np.int64(96),
             model=np.str_("tiny"))
    shape = load_trace(tmp_path / "mine.npz").expert_shape
    assert (shape.model, shape.hidden, shape.ffn) == ("tiny", 512, 96)
    np.savez(tmp_path / "half.npz", topk_ids=ids, expert_hidden=np.int64(512))
    with pytest.raises(ValueError, match="needs both 'expert_hidden' and 'expert_ffn'"):
        load_trace(tmp_path / "half.npz")
    # a fractional or non-scalar size is refused, not truncated; a whole float is taken
    for bad, words in ((np.float64(2.7), "expert_hidden must be one whole number, got float64 2.7"),
                       (np.array([512, 512]), "expert_hidden must be one whole number, got int64 [512, 512]"),
                       (np.float64(np.inf), "expert_hidden must be one whole number, got float64 inf"),
                       # a size no model comes near would give absurd layer times
                       (np.float64(1e30), "expert_hidden must be between 1 and 1048576 (2**20), got 1e+30"),
                       (np.int64(0), "expert_hidden must be between 1 and 1048576 (2**20), got 0")):
        np.savez(tmp_path / "bad.npz", topk_ids=ids, expert_hidden=bad, expert_ffn=np.int64(96))
        with pytest.raises(ValueError, match=re.escape(words)):
            load_trace(tmp_path / "bad.npz")
    # the model's name is one string: an array was printed as the name ("[1 2]")
    for bad, words in ((np.array([1, 2]), "model must be one string (the model's name), got int64 [2]"),
                       (np.array(["a", "b"]), "model must be one string (the model's name), got <U1 [2]")):
        np.savez(tmp_path / "bad.npz", topk_ids=ids, expert_hidden=np.int64(512), expert_ffn=np.int64(96), model=bad)
        with pytest.raises(ValueError, match=re.escape(words)):
            load_trace(tmp_path / "bad.npz")
    np.savez(tmp_path / "float.npz", topk_ids=ids, expert_hidden=np.float64(512.0), expert_ffn=np.int64(96))
    assert load_trace(tmp_path / "float.npz").expert_shape.hidden == 512
    with pytest.raises(ValueError, match="ExpertShape.ffn must be a positive int, got 0"):
        ExpertShape(model="x", hidden=1, ffn=0)
    with pytest.raises(ValueError, match=r"ExpertShape.hidden must be at most 1048576 \(2\*\*20"):
        ExpertShape(model="x", hidden=2 ** 20 + 1, ffn=1)
    assert ExpertShape(model="x", hidden=2 ** 20, ffn=1).hidden == 2 ** 20


def test_olmoe_counts_carry_the_model_shape(tmp_path):
    doc = {"layers": [0], "models": {"mistral": {"top_k": 2, "topk": {"arxiv": [[3, 1, 0, 0, 0, 0, 0, 1]]}}}}
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(doc))
    w = load_workload(f"{path}:model=mistral")
    assert (w.expert_shape.model, w.expert_shape.hidden, w.expert_shape.ffn) == ("Mixtral-8x7B", 4096, 14336)
