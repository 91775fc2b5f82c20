"""Every MoE architecture of the installed transformers under feplb.hf (``feplb.hfcheck``, ``feplb hf-check``): tiny
random models of each, run unmodified and with FEPLB on 2 gloo ranks (rows moving between the node's two "GPUs"),
end exact or refused with a reason, never wrong; the architectures known to work stay exact and those known to be
unsupported stay refused; the check itself reports a defect it is shown (outputs perturbed, a forward that raises);
``feplb.hf.supported`` says what ``apply`` would do without a process group; the CLI writes its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from feplb.testing import error_of, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

# Architectures whose experts FEPLB runs, and why others are refused: kept exact / refused as transformers changes
# (checked where the installed transformers has them).
KNOWN_EXACT = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
               "minimax", "phimoe", "granitemoe", "jamba", "hunyuan_v1_moe", "ernie4_5_moe", "dots1", "flex_olmo",
               "qwen3_vl_moe", "cohere2_moe",
               "aria",          # weights stored [in, out] (is_transposed=True)
               "deepseek_v4",   # the clamped SwiGLU (its own _apply_gate, limit), and hash routing
               "beam",          # its own _apply_gate: SwiGLU in fp32, as FEPLB computes it
               "llama4",        # the whole MoE block: gates on the experts' inputs, weights stored [in, out]
               "gemma4", "diffusion_gemma",   # GeGLU experts (gelu_pytorch_tanh), heterogeneous per-layer configs
               "dots3_note", "lfm2_moe", "deepseek_ocr2",
               "minimax_m3_vl",   # gpt-oss's gate (swiglu_oai: its alpha, clamped), weights not interleaved
               "gpt_oss", "openai_privacy_filter",   # biases, interleaved gate/up, [in, out] weights, its gate
               "nemotron_h",   # non-gated experts: down(relu(up(x))^2)
               "glm4v_moe", "qwen3_omni_moe",   # built with heads of 128 (rotary sections sized for them)
               "muse_spark",    # a norm after each expert (has_post_expert_norm), replicated, on the token's GPU
               "inkling_mm_model",  # (its text model) shared experts stored as 3-D parameters (left replicated)
               "inkling2", "inkling2_loop",   # a softcapped SwiGLU (its own _apply_gate and act_fn's caps)
               "longcat_flash",   # zero-computation experts (masked routes; gate_up_proj holding E + Z experts)
               "step3p7",   # SwiGLU clamped after the activation (silu_postclamp), as its checkpoint's last layers
               "ergo",      # relu^2 experts with an RMSNorm per expert ([E, H] scale given each row's expert id)
               "kolibri1_1")   # its indexer's heads (index_num_heads) set to the tiny model's 2

# (the refusals themselves: test_supported_...)
KNOWN_REFUSED: dict[str, str] = {}


def _survey(rank: int, world: int) -> list[dict]:
    from feplb import hfcheck

    return hfcheck._worker(rank, world, None, {})


@pytest.fixture(scope="module")
def survey():
    from feplb.hfcheck import Outcome

    ranks = run_dist(_survey, 2, timeout_s=900, collective_timeout_s=120)
    assert ranks[0] == ranks[1], "the ranks returned different outcomes"
    return {d["arch"]: Outcome(**d) for d in ranks[0]}


def test_every_architecture_is_exact_or_refused_never_wrong(survey):
    from feplb.hfcheck import TOL

    assert len(survey) >= 30, sorted(survey)   # the scan of transformers' modeling code finds its MoE models
    defects = {a: (o.status, o.detail) for a, o in survey.items() if o.defect}
    assert not defects, defects
    exact = [o for o in survey.values() if o.status == "exact"]
    assert len(exact) >= 20, [o.arch for o in exact]
    for o in exact:
        assert o.replaced >= 1, o
        if o.max_rel > TOL:   # only where the fp64 comparison vouched for it, and then said so
            assert "fp32 rounding error of fp64" in o.detail, o
    assert sum(o.max_rel <= TOL for o in exact) >= 0.8 * len(exact)
    # balancing really moved rows: on most architectures (a tiny model's routing may happen to be even)
    assert sum(o.rows_moved > 0 for o in exact) >= 0.8 * len(exact), [(o.arch, o.rows_moved) for o in exact]
    for o in survey.values():
        if o.status == "refused":
            assert "(" in o.detail and "):" in o.detail, o     # names the module and its class, then why
        if o.status in ("refused", "no experts", "not built"):
            assert o.replaced == 0 and o.rows_moved == 0, o


def test_known_architectures_keep_their_outcome(survey):
    for arch in KNOWN_EXACT:
        if arch in survey:
            assert survey[arch].status == "exact", survey[arch]
    for arch, why in KNOWN_REFUSED.items():
        if arch in survey:
            assert survey[arch].status == "refused" and why in survey[arch].detail, survey[arch]
    present = [a for a in KNOWN_EXACT if a in survey]
    assert len(present) >= len(KNOWN_EXACT) // 2, present


def _defects(rank: int, world: int) -> dict:
    import feplb.hf as fh
    from feplb import hfcheck

    original = fh.FEPLBExperts.forward
    out = {}
    try:
        def perturbed(self, hidden_states, top_k_index, top_k_weights):
            return original(self, hidden_states, top_k_index, top_k_weights) * (1 + 1e-3)

        fh.FEPLBExperts.forward = perturbed
        out["perturbed"] = hfcheck.check(["mixtral"])[0]

        def slightly(self, hidden_states, top_k_index, top_k_weights):
            return original(self, hidden_states, top_k_index, top_k_weights) * (1 + 1e-4)

        # PhiMoE's router draws random numbers in training mode (replayed into its fp64 reference: _Draws)
        fh.FEPLBExperts.forward = slightly
        out["slightly"] = hfcheck.check(["phimoe", "granitemoe"])

        def lost_token(self, hidden_states, top_k_index, top_k_weights):
            y = original(self, hidden_states, top_k_index, top_k_weights)
            return torch.cat([y[:-1], torch.zeros_like(y[-1:])])   # one token's experts dropped

        fh.FEPLBExperts.forward = lost_token
        out["dropped"] = hfcheck.check(["qwen3_moe"])[0]

        # the clamped SwiGLU's limit lost: DeepSeek-V4's tiny model (limit 1) computes plain SwiGLU instead
        gate = fh._gate

        def altered(**change):   # _gate with some of its (activation, limit, alpha, interleaved, softcap) replaced
            def patched(module, ffn):
                why, g = gate(module, ffn)
                if g is None:
                    return why, g
                act, limit, alpha, inter, caps = g
                return why, (change.get("act", act), change.get("limit", limit), change.get("alpha", alpha),
                             change.get("interleaved", inter), change.get("softcap", caps))
            return patched

        fh._gate = altered(limit=None)
        fh.FEPLBExperts.forward = original
        try:
            out["unclamped"] = hfcheck.check(["deepseek_v4"])[0]
        finally:
            fh._gate = gate

        # swiglu_oai's slope lost: MiniMax-M3's gate (alpha 1.702) computed with alpha 1
        fh._gate = altered(alpha=1.0)
        try:
            out["alpha_lost"] = hfcheck.check(["minimax_m3_vl"])[0]
        finally:
            fh._gate = gate

        # Step 3.7's clamp moved before the activation: min(silu(gate), 1) computed as silu(min(gate, 1))
        fh._gate = altered(act="silu")
        try:
            out["clamp_before"] = hfcheck.check(["step3p7"])[0]
        finally:
            fh._gate = gate

        # gpt-oss's layout lost: its interleaved gate / up read as halves
        fh._gate = altered(interleaved=False)
        try:
            out["halves_for_interleaved"] = hfcheck.check(["gpt_oss"])[0]
        finally:
            fh._gate = gate

        # Inkling 2's softcaps swapped (the gate's on the up and back)
        fh._gate = altered(softcap=(25.0, 4.0))
        try:
            out["softcaps_swapped"] = hfcheck.check(["inkling2"])[0]
        finally:
            fh._gate = gate

        # gpt-oss's down-projection bias lost
        weights = fh.FEPLBExperts.expert_weights
        fh.FEPLBExperts.expert_weights = lambda self: (*weights(self)[:3], weights(self)[3] * 0)
        try:
            out["bias_lost"] = hfcheck.check(["gpt_oss"])[0]
        finally:
            fh.FEPLBExperts.expert_weights = weights

        # Muse Spark's norm after each expert lost
        post = fh.FEPLBExperts.post_expert
        fh.FEPLBExperts.post_expert = lambda self, y, e=None: y
        try:
            out["post_norm_lost"] = hfcheck.check(["muse_spark"])[0]
            # Ergo's norm per expert given the next expert's id (transformers >= 5.25)
            fh.FEPLBExperts.post_expert = lambda self, y, e: post(self, y, (e + 1) % self.config.num_experts)
            if "ergo" in hfcheck.moe_architectures():
                out["expert_norm_shifted"] = hfcheck.check(["ergo"])[0]
        finally:
            fh.FEPLBExperts.post_expert = post

        # LongCat's zero-computation experts lost (their tokens not added back)
        zero_out = fh.FEPLBExperts._zero_expert_out
        fh.FEPLBExperts._zero_expert_out = staticmethod(lambda h, zero, w: torch.zeros_like(h))
        try:
            out["zero_experts_lost"] = hfcheck.check(["longcat_flash"])[0]
        finally:
            fh.FEPLBExperts._zero_expert_out = zero_out

        # the activation lost: Gemma 4's GeGLU experts computed as SwiGLU
        kind = fh._act_kind
        fh._act_kind = lambda act, *kinds: None if kind(act, *kinds) is None else "silu"
        try:
            out["swiglu_for_geglu"] = hfcheck.check(["gemma4"])[0]
            # and Nemotron-H's relu^2 experts as silu ones
            out["silu_for_relu2"] = hfcheck.check(["nemotron_h"])[0]
        finally:
            fh._act_kind = kind

        def raising(self, hidden_states, top_k_index, top_k_weights):
            raise RuntimeError("a forward that fails")

        fh.FEPLBExperts.forward = raising
        out["raising"] = hfcheck.check(["olmoe"])[0]
    finally:
        fh.FEPLBExperts.forward = original
    # feplb's own code failing while the tiny model is built (its experts modules' detector, feplb.hf._candidates,
    # failing in a helper it calls): an error, not a limit of the tiny-config recipe ("not built", which exits 0)
    shared = fh._shared_stack

    def failing(name, mod):
        raise RuntimeError("a detector that fails")

    fh._shared_stack = failing
    try:
        out["feplb_build"] = hfcheck.check(["mixtral"])[0]
    finally:
        fh._shared_stack = shared
    out["restored"] = hfcheck.check(["mixtral"])[0]
    out["slightly"] = [vars(o) for o in out["slightly"]]
    return {k: v if isinstance(v, list) else vars(v) for k, v in out.items()} | \
        {"zero_experts_in_experts": _longcat_zero_in_experts()}


def _longcat_zero_in_experts() -> int:
    """The zero-computation experts LongCat-Flash's experts module itself routes (transformers <= 5.24: ids
    E ... E + Z - 1 reach it, and its gate_up_proj holds E + Z experts), or 0 (transformers >= 5.25: the MoE module
    adds the tokens itself and hands its experts module weight-0 routes to real experts)."""
    import feplb.hf as fh
    from feplb.hfcheck import tiny_model

    (experts,) = {m for m in tiny_model("longcat_flash").modules() if type(m).__name__ == "LongcatFlashExperts"}
    return fh._zero_experts(experts)


def _longcat_state(rank: int, world: int) -> dict:
    """LongCat-Flash's experts after apply: each rank's gate_up_proj holds its experts, then its share of the zero
    experts' unused rows; full_state_dict gives back the model's own state dict, bit for bit, also after that full
    state dict is loaded into the applied model; state_dict() refuses the sharded type (no DTensor describes two
    blocks), gives the plain shard with type "local"."""
    import torch.distributed as dist

    import feplb.hf as fh
    from feplb.hfcheck import tiny_model

    model = tiny_model("longcat_flash")
    zero_in_experts = _longcat_zero_in_experts()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = fh.apply(model, gpus_per_node=2)
    ex = model.get_submodule(names[0])
    full = fh.full_state_dict(model, rank0_only=False)
    cfg = model.config
    with torch.no_grad():
        ex.gate_up_proj.zero_()
    model.load_state_dict(before)     # the full checkpoint after apply: each rank keeps its rows (both blocks)
    again = fh.full_state_dict(model, rank0_only=False)
    sharded = error_of(model.state_dict)     # two blocks per rank: no DTensor describes gate_up_proj's shard
    fh.set_state_dict_type(model, "local")
    local = model.state_dict()
    return {"local": list(ex.gate_up_proj.shape), "E": cfg.n_routed_experts, "Z": cfg.zero_expert_num,
            "zero_in_experts": zero_in_experts, "layer_zero": ex.zero_experts,
            "W": dist.get_world_size(), "keys": sorted(full) == sorted(before), "sharded": sharded,
            "local_sd": torch.equal(local[f"{names[0]}.gate_up_proj"], ex.gate_up_proj),
            "whole_load": sorted(again) == sorted(before) and all(torch.equal(again[k], v) for k, v in before.items()),
            "equal": all(torch.equal(full[k], v) for k, v in before.items() if k in full),
            "bad_id": error_of(lambda: ex(torch.randn(3, cfg.hidden_size), torch.full((3, cfg.num_experts_per_tok),
                                                                                         cfg.n_routed_experts +
                                                                                         cfg.zero_expert_num),
                                          torch.ones(3, cfg.num_experts_per_tok)))}


def test_zero_computation_experts_state():
    for r in run_dist(_longcat_state, 2, timeout_s=300, collective_timeout_s=60):
        E, Z, W = r["E"], r["Z"], r["W"]
        assert Z > 0 and r["layer_zero"] == r["zero_in_experts"] in (0, Z), r
        assert r["keys"] and r["equal"], r
        if r["zero_in_experts"]:
            # transformers <= 5.24: the experts module routes the zero experts; each rank keeps its experts, then
            # its share of their unused rows; model.state_dict() for torch.distributed.checkpoint refuses, naming
            # the projection (no DTensor describes two blocks), "local" gives the shard
            assert r["local"][0] == E // W + Z // W, r["local"]
            assert r["sharded"] is not None and "ValueError" in r["sharded"] and "'gate_up_proj'" in r["sharded"], r
        else:
            # transformers >= 5.25: LongCat's MoE adds the zero experts' tokens itself; its experts module holds
            # the E experts only, an experts module like any other
            assert r["local"][0] == E // W, r["local"]
            assert r["sharded"] is None, r["sharded"]
        assert r["local_sd"], r
        assert r["whole_load"], r     # load_state_dict of the full checkpoint after apply
        # ids past the zero experts reach the layer, which refuses them on every rank
        assert r["bad_id"] is not None and "outside" in r["bad_id"], r["bad_id"]


def test_the_check_reports_defects():
    ranks = run_dist(_defects, 2, timeout_s=300, collective_timeout_s=60)
    for res in ranks:
        assert res["perturbed"]["status"] == "WRONG" and res["perturbed"]["max_rel"] > 1e-4, res["perturbed"]
        assert res["dropped"]["status"] == "WRONG", res["dropped"]
        # 1e-4 off: ten times the tolerance, caught also where fp32 rounding alone nears it (Granite's multipliers)
        assert [o["status"] for o in res["slightly"]] == ["WRONG", "WRONG"], res["slightly"]
        assert res["unclamped"]["status"] == "WRONG", res["unclamped"]
        assert res["swiglu_for_geglu"]["status"] == "WRONG", res["swiglu_for_geglu"]
        assert res["silu_for_relu2"]["status"] == "WRONG", res["silu_for_relu2"]
        assert res["alpha_lost"]["status"] == "WRONG", res["alpha_lost"]
        assert res["clamp_before"]["status"] == "WRONG", res["clamp_before"]
        assert res["halves_for_interleaved"]["status"] == "WRONG", res["halves_for_interleaved"]
        assert res["bias_lost"]["status"] == "WRONG", res["bias_lost"]
        assert res["post_norm_lost"]["status"] == "WRONG", res["post_norm_lost"]
        if "expert_norm_shifted" in res:
            assert res["expert_norm_shifted"]["status"] == "WRONG", res["expert_norm_shifted"]
        assert res["softcaps_swapped"]["status"] == "WRONG", res["softcaps_swapped"]
        # FEPLB's own zero experts matter where the experts module routes them (transformers <= 5.24); where the
        # MoE module adds them itself (>= 5.25) the check passes without them
        want = "WRONG" if res["zero_experts_in_experts"] else "exact"
        assert res["zero_experts_lost"]["status"] == want, res["zero_experts_lost"]
        assert res["raising"]["status"] == "error" and "a forward that fails" in res["raising"]["detail"], res
        assert res["feplb_build"]["status"] == "error" and "a detector that fails" in res["feplb_build"]["detail"], \
            res["feplb_build"]
        assert res["restored"]["status"] == "exact", res["restored"]


def test_supported_says_what_apply_would_do_without_a_process_group():
    import feplb.hf as fh
    from feplb.hfcheck import moe_architectures, tiny_model

    model = tiny_model("mixtral")
    got = fh.supported(model)
    assert got and all(why is None for why in got.values()), got
    assert set(got) == {n for n, m in model.named_modules() if type(m).__name__ == "MixtralExperts"}
    assert all("not divisible" in why for why in fh.supported(model, ep_size=3).values())
    assert all(why is None for why in fh.supported(model, ep_size=4, policy="eplb", gpus_per_node=2).values())
    assert all("gpus_per_node=3 does not divide" in why
               for why in fh.supported(model, ep_size=4, gpus_per_node=3).values())
    bad = fh.supported(model, policy="no-such-policy")
    assert all(why.startswith("FEPLBConfig:") for why in bad.values()), bad
    with pytest.raises(TypeError, match="unknown FEPLBConfig field"):
        fh.supported(model, no_such_field=1)
    with pytest.raises(ValueError, match="ep_size"):
        fh.supported(model, ep_size=0)
    # A gate of the module's own: FEPLB's SwiGLU, clamped at the module's limit, or refused.
    ds4 = tiny_model("deepseek_v4")
    experts = [m for m in ds4.modules() if type(m).__name__ == "DeepseekV4Experts"]
    assert experts and all(why is None for why in fh.supported(ds4).values())
    assert fh._problem(experts[0], ds4, 1)[1]["swiglu_limit"] == experts[0].limit > 0
    # Inkling 2's softcapped SwiGLU: its caps found on its act_fn (gate 4, up 25 by default), in that order
    ink2 = tiny_model("inkling2")
    ex = next(m for m in ink2.modules() if type(m).__name__ == "Inkling2Experts")
    fields = fh._problem(ex, ink2, 1)[1]
    assert (fields["activation"], fields["glu_softcap"], fields["swiglu_limit"]) == \
        ("silu_softcap", (ink2.config.mlp_gate_softcap, ink2.config.mlp_up_softcap), None), fields
    mix = model.model.layers[0].mlp.experts

    class GeluGate(type(mix)):   # GeGLU (erf), clamped where a limit is set
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            lim = getattr(self, "limit", None)
            if lim is not None:
                gate, up = gate.clamp(max=lim), up.clamp(-lim, lim)
            return torch.nn.functional.gelu(gate) * up

    geglu = GeluGate(model.config)
    why, fields = fh._problem(geglu, model, 1)
    assert why is None and (fields["activation"], fields["swiglu_limit"]) == ("gelu", None), why
    geglu.limit = 3.0
    why, fields = fh._problem(geglu, model, 1)
    assert why is None and (fields["activation"], fields["swiglu_limit"]) == ("gelu", 3.0), why

    class ReluGate(type(mix)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.relu(gate) * up

    odd = ReluGate(model.config)
    assert "computes none of FEPLB's act(gate) * up for act in ('silu', 'gelu_tanh', 'gelu', 'swiglu_oai')" in \
        fh._problem(odd, model, 1)[0]
    odd.limit = 3.0   # a limit attribute is tried too, and still does not make relu one of them
    assert "plain or clamped at limit 3" in fh._problem(odd, model, 1)[0]

    class ClampedGate(type(mix)):
        limit = 2.5

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    why, fields = fh._problem(ClampedGate(model.config), model, 1)
    assert why is None and fields["swiglu_limit"] == 2.5, why

    class HiddenClamp(type(mix)):   # clamps at a bound kept where FEPLB does not look, far above typical values
        clamp_value = 20.0

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate.clamp(max=self.clamp_value)) * up

    assert "computes none of FEPLB's" in fh._problem(HiddenClamp(model.config), model, 1)[0]

    class InPlace(type(mix)):   # changes its input in place: judged by what it returns for the probe it was given
        def _apply_gate(self, gate_up):
            gate_up.mul_(2)
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    assert "computes none of FEPLB's" in fh._problem(InPlace(model.config), model, 1)[0]

    class SplitGate(type(mix)):   # plain SwiGLU that splits by the module's own width
        def _apply_gate(self, gate_up):
            gate, up = gate_up.split(self.intermediate_dim, dim=-1)
            return torch.nn.functional.silu(gate) * up

    why, fields = fh._problem(SplitGate(model.config), model, 1)
    assert why is None and fields["swiglu_limit"] is None, why
    # shared experts stored as 3-D parameters and called without the routing (Inkling's) are left alone; a module
    # held as shared_experts that transformers made an experts class, or that takes the routing, is not
    shared = torch.nn.Module()
    shared.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 3))
    shared.forward = lambda hidden_states, gammas: hidden_states
    assert fh._shared_stack("model.layers.0.mlp.shared_experts", shared)
    assert not fh._shared_stack("model.layers.0.mlp.experts", shared)
    assert not fh._shared_stack("model.layers.0.mlp.shared_experts", mix)
    shared.forward = lambda hidden_states, top_k_index, top_k_weights: hidden_states
    assert not fh._shared_stack("model.layers.0.mlp.shared_experts", shared)
    if "ergo" in moe_architectures():   # transformers >= 5.25
        # Ergo's norm per expert: found by its call (rows, expert ids), its parameters one row per expert
        ergo = tiny_model("ergo")
        ex = next(m for m in ergo.modules() if type(m).__name__ == "ErgoExperts")
        assert fh._problem(ex, ergo, 2) == (None, fh._problem(ex, ergo, 2)[1])
        assert fh._problem(ex, ergo, 2)[1]["per_expert_norm"] is True
        E, H = ex.post_expert_norm.weight.shape
        ex.post_expert_norm.weight = torch.nn.Parameter(torch.ones(E + 1, H))
        assert "expected each [8, ...] (two dimensions or more), one row per expert" in fh._problem(ex, ergo, 2)[0]
        ex.post_expert_norm.weight = torch.nn.Parameter(torch.ones(E))   # [E]: one number, not a row, per expert
        assert "one row per expert" in fh._problem(ex, ergo, 2)[0]
        ex.has_post_expert_norm = True   # the flag set too: the call still decides (ids given)
        ex.post_expert_norm.weight = torch.nn.Parameter(torch.ones(E, H))
        assert fh._problem(ex, ergo, 2)[1]["per_expert_norm"] is True
        del ex.has_post_expert_norm
        ex.post_expert_norm.weight = torch.nn.Parameter(torch.ones(E, H))
        ex.post_expert_norm.forward = lambda hidden_states: hidden_states   # a norm not called with the ids
        assert "parameters besides up_proj and down_proj" in fh._problem(ex, ergo, 2)[0]
    aria = tiny_model("aria")   # is_transposed=True: gate_up_proj [E, H, 2F], down_proj [E, F, H]
    assert aria.model.layers[0].mlp.experts.is_transposed
    assert fh.supported(aria) and all(why is None for why in fh.supported(aria).values())
    # Llama 4: transformers' own MoE block is replaced whole; a block of another class (which may compute otherwise)
    # leaves its experts, called with router-scaled inputs, to the generic check, which refuses them
    llama = tiny_model("llama4")
    assert fh.supported(llama) and all(why is None for why in fh.supported(llama).values())
    block = llama.model.layers[0].feed_forward

    class OtherBlock(type(block)):
        pass

    llama.model.layers[0].feed_forward = OtherBlock(llama.config)
    got = fh.supported(llama)
    assert "forward(hidden_states)" in got["model.layers.0.feed_forward.experts"], got
    assert got["model.layers.1.feed_forward.experts"] is None, got
    # a block passed as the whole model is not replaced in a parent (there is none): refused as before
    assert all(why and "forward(hidden_states)" in why for why in fh.supported(block).values())
    # one experts module in two blocks (each with its own router), or reachable outside its block: refused
    two = tiny_model("llama4")
    layers = two.model.layers
    layers[0].feed_forward.experts = layers[1].feed_forward.experts
    assert all(why and "several MoE blocks" in why for why in fh.supported(two).values()), fh.supported(two)
    alias = tiny_model("llama4")
    alias.model.extra = alias.model.layers[1].feed_forward.experts
    assert "outside its MoE block" in fh.supported(alias)["model.extra"], fh.supported(alias)
    # the router's top-k is the block's selection (the block's own top_k attribute is unused by its forward)
    odd = tiny_model("llama4")
    ff = odd.model.layers[0].feed_forward
    ff.router.top_k, ff.top_k = 2, 1
    assert fh._problem(ff.experts, odd, 1, fh._llama4_blocks(odd)[id(ff.experts)],
                       "model.layers.0.feed_forward.experts")[1]["top_k"] == 2
    # Inkling: its routed experts run, its shared experts (3-D gate_proj, up_proj, down_proj) stay replicated; called
    # like routed experts, such a module is refused for its separate gate_proj
    ink = tiny_model("inkling_text")
    got = fh.supported(ink)
    assert got and all(why is None for why in got.values()) and not any("shared" in n for n in got), got
    sh = ink.model.layers[0].mlp.shared_experts

    class Routed(type(sh)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    sh.__class__ = Routed
    refused = fh.supported(ink)
    assert refused["model.layers.0.mlp.shared_experts"] and \
        "gate_proj parameter apart from up_proj" in refused["model.layers.0.mlp.shared_experts"], refused
    nem = tiny_model("nemotron_h")
    ((name, why),) = fh.supported(nem).items()
    fields = fh._problem(nem.get_submodule(name), nem, 1)[1]
    assert why is None and not fields["gated"] and fields["activation"] == "relu2", (why, fields)
    oss = tiny_model("gpt_oss")
    experts = oss.model.layers[0].mlp.experts
    why, fields = fh._problem(experts, oss, 1)
    assert why is None and fields["expert_bias"] and fields["glu_interleaved"] and fields["transposed"], why
    assert (fields["activation"], fields["swiglu_limit"], fields["swiglu_alpha"]) == \
        ("swiglu_oai", experts.limit, experts.alpha), fields
    assert fh.supported(torch.nn.Linear(4, 4)) == {}
    # nothing was replaced or changed
    assert not fh.experts_modules(model) and type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


def test_tiny_models_are_tiny_deterministic_and_hold_experts():
    from feplb.hfcheck import tiny_model

    a, b = tiny_model("qwen3_moe", seed=3), tiny_model("qwen3_moe", seed=3)
    assert a.training and a.config.num_hidden_layers == 2 and a.config.hidden_size <= 256
    assert sum(p.numel() for p in a.parameters()) < 5_000_000
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), tiny_model("qwen3_moe", seed=4).parameters(),
                                                       strict=True))
    experts = [m for m in a.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert experts and experts[0].gate_up_proj.shape[0] == 8


def test_each_architecture_is_listed_once_by_its_outermost_config():
    """A multimodal model's text, vision or audio part is surveyed through the model type holding it (its text model
    is the one built), never on its own; every modeling folder with an experts module gives at least one type."""
    import glob

    import transformers
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    from feplb.hfcheck import _EXPERTS_SOURCE, moe_architectures

    archs = moe_architectures()
    assert archs == sorted(set(archs))
    folder = {t: model_type_to_module_name(t) for t in CONFIG_MAPPING_NAMES}
    root = Path(transformers.__file__).parent / "models"
    with_experts = {Path(p).parent.name for p in glob.glob(str(root / "*" / "modeling_*.py"))
                    if _EXPERTS_SOURCE.search(Path(p).read_text(encoding="utf-8"))}
    assert {folder[t] for t in archs} == with_experts
    for t in archs:
        others = [u for u in CONFIG_MAPPING_NAMES if folder[u] == folder[t] and u != t]
        holders = [u for u in others if CONFIG_MAPPING[t] in getattr(CONFIG_MAPPING[u], "sub_configs", {}).values()]
        assert not holders, f"{t} is a part of {holders}"
        if folder[t] == t:
            assert not [u for u in others if u in archs], t   # the type named like its folder stands for it
    # transformers 5.25's Inkling: one composite type whose folder has no type of its name, with text, vision and
    # audio parts; only the composite is listed (the vision and audio encoders hold no experts)
    if "inkling_mm_model" in CONFIG_MAPPING_NAMES:
        assert "inkling_mm_model" in archs
        assert not {"inkling_text", "inkling_vision", "inkling_audio"} & set(archs)


def test_cli_writes_the_table(tmp_path, capsys):
    from feplb.cli import main

    md, js = tmp_path / "hf.md", tmp_path / "hf.json"
    (tmp_path / "target.md").write_text("")
    md.symlink_to("target.md")      # written through: the link stays
    # (llama: a dense model, named as a user may name one: no experts, not a recipe failure)
    assert main(["hf-check", "mixtral", "longcat_flash", "llama", "--markdown", str(md), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert "mixtral" in printed and "3 architectures: 2 exact, 1 no experts" in printed, printed
    assert md.is_symlink() and f"wrote {tmp_path / 'target.md'}" in printed, printed
    text = md.read_text()
    assert "| `mixtral` | exact | 2 |" in text and "| `longcat_flash` | exact | 1 |" in text, text
    doc = json.loads(js.read_text())
    assert doc["meta"]["ranks"] == 2 and doc["meta"]["command"].startswith("feplb hf-check mixtral")
    assert {o["arch"]: o["status"] for o in doc["outcomes"]} == {"mixtral": "exact", "longcat_flash": "exact",
                                                                 "llama": "no experts"}


@pytest.mark.parametrize("argv, message", [
    (["no_such_arch"], "unknown transformers model type"),
    (["mixtral", "--ranks", "3"], "must divide the tiny models' 8 experts"),
    (["mixtral", "--ranks", "4", "--gpus-per-node", "3"], "must divide --ranks"),
    (["mixtral", "--markdown", "x.out", "--json", "./x.out"], "name the same file"),
    (["mixtral", "--policy", "nope"], "--policy nope"),
    (["mixtral", "--markdown", "/no/such/folder/x.md"], "does not exist"),
])
def test_cli_refuses_bad_input_before_starting(argv, message, capsys):
    from feplb.cli import main

    assert main(["hf-check", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _ergo_bf16(rank: int, world: int) -> dict:
    """Ergo's experts module in bf16 with its per-expert norm scales in fp32 (transformers keeps them so), balancing
    on, skewed routing: ``full_state_dict`` gives the model's own state dict back; FEPLB against the unmodified
    module, both against the module in fp32; output and every gradient (the unmodified module's expert gradients
    summed over the ranks' inputs, and the replicated norm's of both)."""
    import copy

    import torch.distributed as dist

    import feplb.hf as fh
    from feplb.hfcheck import tiny_model

    model = tiny_model("ergo").to(torch.bfloat16)
    name = next(n for n, m in model.named_modules() if type(m).__name__ == "ErgoExperts")
    model.get_submodule(name).post_expert_norm.float()
    ref = copy.deepcopy(model.get_submodule(name))
    ref32 = copy.deepcopy(ref).float()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fh.apply(model, policy="feplb-split", gpus_per_node=2, min_chunk=1, plan_wait_ms=60_000, min_straggler_rows=0)
    mine = model.get_submodule(name)
    full = fh.full_state_dict(model, rank0_only=False)   # the original names, shapes, dtypes and values
    same_state = sorted(full) == sorted(before) and all(torch.equal(full[k], v) and full[k].dtype == v.dtype
                                                        for k, v in before.items())
    E, H = ref.up_proj.shape[0], ref.up_proj.shape[1]
    gen = torch.Generator().manual_seed(70 + rank)
    T = 24
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    probs = torch.ones(E)
    probs[0] = 8.0                      # expert 0 is hot: balancing moves rows
    idx = torch.stack([torch.multinomial(probs, 2, generator=gen) for _ in range(T)])
    wts = torch.rand(T, 2, generator=gen)

    sharded = {id(p) for p in fh.expert_parameters(model)}

    def run(m, dtype):
        xx, ww = x.to(dtype).requires_grad_(), wts.clone().requires_grad_()
        out = m(xx, idx, ww)
        (out.float() * dy).sum().backward()
        grads = {n: p.grad.float() for n, p in m.named_parameters()}
        for n, p in m.named_parameters():
            if id(p) not in sharded:   # the gradient of every rank's input (FEPLB's shards hold theirs already)
                dist.all_reduce(grads[n])
        return {"out": out.detach().float(), "x": xx.grad.float(), "weights": ww.grad} | grads

    got, theirs, exact = run(mine, torch.bfloat16), run(ref, torch.bfloat16), run(ref32, torch.float32)
    L = E // world
    for t in (theirs, exact):
        for n in ("up_proj", "down_proj"):
            t[n] = t[n][rank * L:(rank + 1) * L]

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    return {"dtypes": (str(mine.up_proj.dtype), str(mine.post_expert_norm.weight.dtype)),
            "errors": {k: (rel(got[k], exact[k]), rel(theirs[k], exact[k]), rel(got[k], theirs[k])) for k in exact},
            "moved": mine.last_stats.rows_moved, "same_state": same_state}


def test_ergo_in_bf16_with_its_fp32_norm_scales():
    from feplb.hfcheck import moe_architectures

    if "ergo" not in moe_architectures():
        pytest.skip("transformers < 5.25 has no Ergo")
    for res in run_dist(_ergo_bf16, 2, timeout_s=300, collective_timeout_s=60):
        assert res["dtypes"] == ("torch.bfloat16", "torch.float32"), res["dtypes"]
        assert res["moved"] > 0 and res["same_state"], res
        for k, (mine, theirs, between) in res["errors"].items():
            # as close to fp32 as the unmodified bf16 module, and near it
            assert mine <= 1.25 * theirs + 1e-6 and between <= 1e-2, (k, mine, theirs, between)
            assert mine < 2e-2, (k, mine)


def test_draws_replayed_into_the_fp64_reference():
    """The fp64 reference of a sampling forward gets the fp32 run's draws, in order, cast; a replayed run that draws
    otherwise (another shape, fewer or more draws) is no reference."""
    from feplb.hfcheck import _Draws

    def forward(dtype):
        a = torch.rand(3, dtype=dtype)
        b = torch.empty(2, 2, dtype=dtype).exponential_()
        return a, b, torch.rand_like(b) > 0.5

    torch.manual_seed(5)
    with _Draws() as rec:
        a32, b32, m32 = forward(torch.float32)
    assert len(rec.drawn) == 3
    torch.manual_seed(6)    # another seed: the replay, not the generator, decides
    with _Draws(rec.drawn) as rep:
        a64, b64, m64 = forward(torch.float64)
    assert rep.matched and a64.dtype == torch.float64
    assert torch.equal(a64, a32.double()) and torch.equal(b64, b32.double()) and torch.equal(m64, m32)
    with _Draws(rec.drawn) as rep:
        torch.rand(4, dtype=torch.float64)
    assert not rep.matched                           # another shape
    with _Draws(rec.drawn) as rep:
        torch.rand(3, dtype=torch.float64)
    assert not rep.matched                           # draws left over
    with _Draws(rec.drawn[:1]) as rep:
        forward(torch.float64)
    assert not rep.matched                           # more draws than recorded
    with _Draws(rec.drawn) as rep:
        torch.randn(3, dtype=torch.float64)
        torch.empty(2, 2, dtype=torch.float64).exponential_()
        torch.rand(2, 2, dtype=torch.float64)
    assert not rep.matched                           # another op (of the same shapes)
    # functions that draw inside, whose noise the mode cannot replace: no reference where they draw
    x = torch.randn(4, 4)
    for fn, draws in ((lambda: torch.nn.functional.dropout(x, 0.5, True), True),
                      (lambda: torch.nn.functional.dropout(x, p=0.0, training=True), False),
                      (lambda: torch.nn.functional.dropout(x, 0.5, training=False), False),
                      (lambda: torch.nn.functional.gumbel_softmax(x), True),
                      (lambda: torch.nn.functional.rrelu(x, training=True), True),
                      (lambda: torch.nn.functional.rrelu(x), False)):
        with _Draws() as rec:
            fn()
        assert rec.matched == (not draws), (fn, draws)
