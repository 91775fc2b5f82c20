"""``model.generate`` of a model ``feplb.hf.apply`` made expert-parallel, on 2 gloo ranks whose sequences end at
different steps: it keeps the ranks in step by itself (``synced_gpus=True`` whatever the caller passes, as
transformers' Seq2SeqTrainer passes False) and generates what the unmodified model generates; so does an outer
model's ``generate`` after ``feplb.hf.generate_in_step`` where ``apply`` was given its decoder. Continuous batching,
under which the ranks would run different numbers of collective forwards, is refused (on every rank together for
``generate``)."""

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
    out["explicit_false"] = (model.generate(prompt, synced_gpus=False, **kw), ref.generate(prompt, **kw))
    # asked on rank 0 only: every rank raises, naming it
    out["paged"] = error_of(lambda: model.generate(prompt, cache_implementation="paged" if rank == 0 else None,
                                                   **kw))
    out["batch"] = [error_of(lambda: model.generate_batch([[1, 2, 3]])),
                    error_of(lambda: model.init_continuous_batching())]
    # after the refusals the ranks are still in step
    out["after"] = (model.generate(prompt, **kw), ref.generate(prompt, **kw))
    # apply given the decoder alone: the outer model's generate kept in step by generate_in_step
    outer = models.make_model(arch).eval()
    feplb.hf.apply(outer.model, policy="feplb-split", gpus_per_node=world, min_straggler_rows=0)
    out["outer_has_generate"] = feplb.hf.generate_in_step(outer)
    out["outer"] = (outer.generate(prompt, **kw), ref.generate(prompt, **kw))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_generate_keeps_the_ranks_in_step(arch):
    runs = run_dist(_generate, W, arch, timeout_s=240, collective_timeout_s=60)
    for rank, r in enumerate(runs):
        for case in ("cache=True", "cache=False", "explicit_true", "explicit_false", "after", "outer"):
            got, want = r[case]
            assert torch.equal(got, want), (rank, case, got, want)
            assert got.shape[1] == 5 + (2 if rank == 0 else 7), (rank, case, got.shape)
        assert r["paged"] is not None and r["paged"].startswith("ValueError") and "continuous batching" in \
            r["paged"] and "(on rank(s) [0])" in r["paged"], r["paged"]
        for name, err in zip(("generate_batch", "init_continuous_batching"), r["batch"], strict=True):
            assert err is not None and name in err and "continuous batching" in err, err
        assert r["outer_has_generate"]
