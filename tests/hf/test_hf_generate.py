"""``model.generate`` of a model ``feplb.hf.apply`` made expert-parallel, on 2 gloo ranks whose sequences end at
different steps: it keeps the ranks in step by itself (``synced_gpus=True`` unless asked otherwise) and generates
what the unmodified model generates; ``synced_gpus=False`` and continuous batching, under which the ranks would run
different numbers of collective forwards, are refused on every rank together."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from feplb.testing import error_of, load_module, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

W = 2


def _models():
    return load_module(Path(__file__).with_name("models.py"))


def _generate(rank: int, world: int, arch: str) -> dict:
    import feplb.hf

    models = _models()
    model = models.make_model(arch).eval()
    ref = copy.deepcopy(model)
    feplb.hf.apply(model, policy="feplb-split", gpus_per_node=world, min_straggler_rows=0)
    prompt = models.tokens(rank, batch=2, seq=5)
    # rank 0 stops after 2 new tokens, rank 1 after 7: without keeping in step, rank 1's later forwards would wait
    # for a rank that stopped calling the layers
    # (with an attention mask: transformers 5.25's synced_gpus without a cache fails without one, FEPLB or not)
    kw = dict(max_new_tokens=2 if rank == 0 else 7, do_sample=False, pad_token_id=0, eos_token_id=None,
              attention_mask=torch.ones_like(prompt))
    out = {}
    for cache in (True, False):
        got = model.generate(prompt, use_cache=cache, **kw)
        want = ref.generate(prompt, use_cache=cache, **kw)    # local: the unmodified model, no collective
        out[f"cache={cache}"] = (got, want)
    out["explicit_true"] = (model.generate(prompt, synced_gpus=True, **kw), ref.generate(prompt, **kw))
    # asked on rank 0 only: every rank raises, naming it
    out["synced_false"] = error_of(lambda: model.generate(prompt, synced_gpus=False if rank == 0 else None, **kw))
    out["paged"] = error_of(lambda: model.generate(prompt, cache_implementation="paged", **kw))
    out["batch"] = error_of(lambda: model.generate_batch([[1, 2, 3]]))
    # after the refusals the ranks are still in step
    out["after"] = (model.generate(prompt, **kw), ref.generate(prompt, **kw))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_generate_keeps_the_ranks_in_step(arch):
    runs = run_dist(_generate, W, arch, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(runs):
        for case in ("cache=True", "cache=False", "explicit_true", "after"):
            got, want = r[case]
            assert torch.equal(got, want), (rank, case, got, want)
            assert got.shape[1] == 5 + (2 if rank == 0 else 7), (rank, case, got.shape)
        assert r["synced_false"] is not None and r["synced_false"].startswith("ValueError") and \
            "synced_gpus=False" in r["synced_false"] and "(on rank(s) [0])" in r["synced_false"], r["synced_false"]
        assert r["paged"] is not None and "continuous batching" in r["paged"], r["paged"]
        assert r["batch"] is not None and "generate_batch" in r["batch"] and "continuous batching" in r["batch"], \
            r["batch"]
