"""Calibrated per-layer policies: the shared table and choice, JSON, calibrate() on the tiny
models of every diffusers family, and apply(policy=...) following the per-layer entries."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import nvfp4_dit
from nvfp4_dit.calibration import (DEFAULT_BUDGET, KEEP_MASS_LADDER, CalibrationTable, choose_precision, format_table,
                                   measurement_policy)
from nvfp4_dit.policy import EXACT, FP4_PRECISIONS, PRECISIONS, AttentionPolicy, LayerPrecision, Precision, step_bucket

NV, NVB, MXB = FP4_PRECISIONS   # nvfp4, nvfp4 with the channel balance, mxfp8 with it

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


# -- the shared pieces (no diffusers) ---------------------------------------------------------------

def test_step_buckets_split_the_schedule_in_thirds():
    assert [step_bucket((i, 9)) for i in range(9)] == ["first"] * 3 + ["middle"] * 3 + ["last"] * 3
    assert step_bucket(None) == "middle" and step_bucket((0, 1)) == "first"


def test_choose_precision_takes_the_cheapest_within_budget():
    assert PRECISIONS == (Precision("nvfp4", False), Precision("nvfp4", True), Precision("mxfp8", True), EXACT)
    assert [p.label for p in PRECISIONS] == ["nvfp4", "nvfp4+balance", "mxfp8+balance", "exact"]
    assert choose_precision({NV: 0.10, NVB: 0.09, MXB: 0.05}, 0.25) == NV
    assert choose_precision({NV: 0.30, NVB: 0.20, MXB: 0.05}, 0.25) == NVB
    assert choose_precision({NV: 0.30, NVB: 0.26, MXB: 0.10}, 0.25) == MXB
    assert choose_precision({NV: 0.30, NVB: 0.26, MXB: 0.26}, 0.25) == EXACT
    assert choose_precision({NV: 0.25}, 0.25) == NV


def test_table_accumulates_relative_l2_over_calls():
    t = CalibrationTable()
    t.add("a", (0, 6), NVB, 1.0, 100.0)
    t.add("a", (1, 6), NVB, 3.0, 300.0)  # same bucket (first third)
    t.add("a", (5, 6), NVB, 9.0, 100.0)
    errs = t.errors()
    assert errs[("a", "first")][NVB] == pytest.approx(0.1)
    assert errs[("a", "last")][NVB] == pytest.approx(0.3)
    pol = t.policy(AttentionPolicy(backend="reference"), budget=0.2, model_class="M")
    assert {(e.layer, e.bucket): e.precision for e in pol.per_layer} == {("a", "first"): NVB, ("a", "last"): EXACT}
    assert pol.model_class == "M" and pol.budget == 0.2 and pol.backend == "reference"
    assert "| a | first | nvfp4+balance |" in format_table(pol)
    with pytest.raises(ValueError, match="precision"):
        t.add("a", None, EXACT, 0.0, 1.0)
    with pytest.raises(ValueError, match="budget"):
        t.policy(AttentionPolicy(), budget=0, model_class=None)


def test_the_sparse_ladder_picks_the_least_modelled_time_within_budget():
    """Per layer: the run with the least modelled time (precision time x density) within budget."""
    t = CalibrationTable()
    outs = {None: 0.05, 0.95: 0.06, 0.9: 0.09, 0.8: 0.3}       # relative error of each keep_mass
    density = {None: 1.0, 0.95: 0.6, 0.9: 0.4, 0.8: 0.2}
    exact = torch.ones(100)

    def run(precision, keep_mass):
        extra = 0.02 if precision == MXB else 0.0
        return exact * (1 + outs[keep_mass] + extra), density[keep_mass]

    assert t.measure("a", (3, 6), exact, run, ladder=(0.95, 0.9, 0.8))
    assert t.measure("b", (3, 6), exact, run)                    # no ladder: a dense-only layer
    pol = t.policy(AttentionPolicy(keep_mass=0.9), budget=0.1, model_class=None)
    a, b = pol.per_layer
    assert (a.precision, a.keep_mass, a.density) == (NV, 0.9, pytest.approx(0.4))
    assert len(a.sparse_errors) == 9 and dict(a.errors)[NV] == pytest.approx(0.05)
    assert (b.precision, b.keep_mass, b.density, b.sparse_errors) == (NV, None, None, ())
    # A tighter budget: only dense fits (recorded as keep_mass 1.0: measured, dense is best).
    tight = t.policy(AttentionPolicy(keep_mass=0.9), budget=0.055, model_class=None).per_layer[0]
    assert (tight.precision, tight.keep_mass) == (NV, 1.0)
    assert "| a | middle | nvfp4 | 0.9 | 0.400 |" in format_table(pol)
    assert pol.describe().endswith("1 block-sparse (mean density 0.400)")
    # Nothing ran dense: nothing is added.
    assert not t.measure("c", None, exact, lambda p, k: None, ladder=(0.9,))


def test_block_density_of_a_structured_call():
    g = torch.Generator().manual_seed(0)
    dirs = torch.nn.functional.normalize(torch.randn(2, 16, 64, generator=g), dim=-1) * 8.0
    base = dirs.repeat_interleave(128, dim=1).transpose(0, 1)[None]          # block i attends tile i
    q = base + 0.5 * torch.randn(1, 2048, 2, 64, generator=g)
    k = base + 0.5 * torch.randn(1, 2048, 2, 64, generator=g)
    from nvfp4_dit.sparse import Sparsity

    kw = dict(layout="NHD", causal=False, scale=None, key_mask=None)
    assert nvfp4_dit.ops.block_density(q, k, sparsity=Sparsity(keep_mass=0.8), **kw) < 0.2
    assert nvfp4_dit.ops.block_density(q, k, sparsity=Sparsity(keep_mass=1.0), **kw) == 1.0


def test_layer_precision_and_policy_validate():
    with pytest.raises(ValueError, match="bucket"):
        LayerPrecision("a", "early", NVB)
    with pytest.raises(TypeError, match="precision"):
        LayerPrecision("a", "first", "nvfp4")
    with pytest.raises(ValueError, match="qk_format"):
        Precision("fp8", True)
    with pytest.raises(ValueError, match="balance"):
        Precision(None, True)
    with pytest.raises(ValueError, match="twice"):
        AttentionPolicy(per_layer=[LayerPrecision("a", "first", EXACT)] * 2)
    with pytest.raises(TypeError, match="per_layer"):
        AttentionPolicy(per_layer=[("a", "first", EXACT)])
    with pytest.raises(ValueError, match="budget"):
        AttentionPolicy(budget=-1.0)


def test_policy_json_round_trip_and_bad_files(tmp_path):
    pol = AttentionPolicy(backend="reference", dense_steps=(2, 1), min_seq_len=128, layers=("blocks.*",),
                          per_layer=[LayerPrecision("blocks.0.attn1", "middle", NVB, ((NV, 0.3), (NVB, 0.1)))],
                          model_class="WanTransformer3DModel", budget=0.25)
    path = tmp_path / "p.json"
    pol.save(path)
    assert AttentionPolicy.load(path) == pol
    entry = json.loads(path.read_text())["per_layer"][0]
    assert entry["qk_format"] == "nvfp4" and entry["balance_qk"] is True
    assert entry["errors"] == [{"qk_format": "nvfp4", "balance_qk": False, "error": 0.3},
                               {"qk_format": "nvfp4", "balance_qk": True, "error": 0.1}]
    assert pol.precision_for("blocks.0.attn1", (4, 9)) == NVB
    assert pol.precision_for("blocks.0.attn1", (0, 9)) is None and pol.precision_for("x", None) is None
    for text, match in [("{", "not a policy JSON"), ('{"version": 7}', "version"),
                        ('{"version": 2, "colour": 1}', "unknown fields"),
                        ('{"version": 2, "per_layer": [{"layer": "a"}]}', "not a valid"),
                        ('{"version": 1, "per_layer": [{"layer": "a", "bucket": "first", "precision": "fp8"}]}',
                         "unknown precision")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            AttentionPolicy.load(path)
        assert str(path) in str(e.value)


# A calibrated policy as the previous file version wrote it (fused precision names).
VERSION1_POLICY = """{
 "version": 1, "backend": "auto", "self_attention": true, "cross_attention": false, "dense_steps": [1, 1],
 "min_seq_len": 1024, "layers": null, "balance_qk": true, "qk_format": "nvfp4",
 "per_layer": [
  {"layer": "transformer.blocks.0.attn1", "bucket": "first", "precision": "nvfp4-unbalanced",
   "errors": {"mxfp8": 0.0351, "nvfp4": 0.0688, "nvfp4-unbalanced": 0.0688}},
  {"layer": "transformer.blocks.1.attn1", "bucket": "middle", "precision": "mxfp8", "errors": {"mxfp8": 0.2}},
  {"layer": "transformer.blocks.1.attn1", "bucket": "last", "precision": "dense", "errors": {}},
  {"layer": "transformer.blocks.0.attn1", "bucket": "last", "precision": "nvfp4", "errors": {}}],
 "model_class": "WanTransformer3DModel", "budget": 0.25
}
"""


def test_version1_policy_files_keep_loading(tmp_path):
    path = tmp_path / "old.policy.json"
    path.write_text(VERSION1_POLICY)
    pol = AttentionPolicy.load(path)
    assert [(e.layer, e.bucket, e.precision) for e in pol.per_layer] == [
        ("transformer.blocks.0.attn1", "first", NV), ("transformer.blocks.1.attn1", "middle", MXB),
        ("transformer.blocks.1.attn1", "last", EXACT), ("transformer.blocks.0.attn1", "last", NVB)]
    assert dict(pol.per_layer[0].errors) == {MXB: 0.0351, NVB: 0.0688, NV: 0.0688}
    pol.save(path)   # written back in the current version, read back the same
    assert json.loads(path.read_text())["version"] == 3 and AttentionPolicy.load(path) == pol
    assert all(e.keep_mass is None and e.density is None and e.sparse_errors == () for e in pol.per_layer)


def test_version2_policy_files_keep_loading(tmp_path):
    """Version 2 (no sparsity per layer): every layer follows the policy's own keep_mass."""
    path = tmp_path / "v2.policy.json"
    d = AttentionPolicy(keep_mass=0.9, per_layer=(LayerPrecision("blocks.0.attn1", "middle", NV, ((NV, 0.1),)),)).to_dict()
    d["version"] = 2
    for e in d["per_layer"]:
        for key in ("keep_mass", "density", "sparse_errors"):
            del e[key]
    path.write_text(json.dumps(d))
    pol = AttentionPolicy.load(path)
    assert pol.per_layer[0].keep_mass is None
    assert pol.keep_mass_for((5, 10), 20000, 20000, "blocks.0.attn1") == 0.9


def test_a_layers_calibrated_keep_mass_overrides_the_policys():
    entries = (LayerPrecision("a", "middle", NV, keep_mass=0.8, density=0.3, sparse_errors=((NV, 0.8, 0.1, 0.3),)),
               LayerPrecision("b", "middle", NV, keep_mass=1.0), LayerPrecision("c", "middle", NV))
    pol = AttentionPolicy(keep_mass=0.9, sparse_off_steps=(0, 0), sparse_min_seq_len=100, per_layer=entries)
    step = (5, 10)
    assert [pol.keep_mass_for(step, 200, 200, layer) for layer in ("a", "b", "c", None)] == [0.8, None, 0.9, 0.9]
    assert pol.keep_mass_for(step, 50, 200, "a") is None            # below sparse_min_seq_len
    assert AttentionPolicy.from_dict(pol.to_dict()) == pol
    with pytest.raises(ValueError, match="exact"):
        LayerPrecision("d", "middle", EXACT, keep_mass=0.9)
    with pytest.raises(ValueError, match="density"):
        LayerPrecision("d", "middle", NV, keep_mass=0.9, density=1.5)


# -- calibrate() on the tiny models ---------------------------------------------------------------------

diffusers = pytest.importorskip("diffusers")

from nvfp4_dit import ops  # noqa: E402
from nvfp4_dit.processors import routing  # noqa: E402
from nvfp4_dit.processors.tiny_models.diffusers_families import FAMILIES, build  # noqa: E402
from nvfp4_dit.processors.tiny_models.pipeline import build_tiny_pipeline  # noqa: E402

BASE = AttentionPolicy(backend="reference", min_seq_len=256)
STEPS = 6


def _pipe():
    pipe = build_tiny_pipeline(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe):
    return pipe("a red fox", num_inference_steps=STEPS, output_type="latent").frames


def _force_layers(pipe):
    """Block 1's self-attention 3x sharper (4-bit Q/K error too large for the budget, MXFP8 fits);
    block 0's K with 16 channels x30 and Q's same channels /30 (same logits; FP4 fits only with
    the balance)."""
    with torch.no_grad():
        b1 = pipe.transformer.blocks[1].attn1
        b1.norm_q.weight.mul_(3.0)
        b1.norm_k.weight.mul_(3.0)
        b0 = pipe.transformer.blocks[0].attn1
        b0.norm_k.weight[::8] *= 30.0
        b0.norm_q.weight[::8] /= 30.0


def _assignments(policy):
    return {(e.layer, e.bucket): e.precision for e in policy.per_layer}


def errs_to_policy(policy, budget):
    """The same measurements under another budget (no second calibration run)."""
    entries = [LayerPrecision(e.layer, e.bucket, choose_precision(dict(e.errors), budget), e.errors)
               for e in policy.per_layer]
    return policy.replace(per_layer=entries, budget=budget)


@pytest.fixture(scope="module")
def forced():
    pipe = _pipe()
    _force_layers(pipe)
    return pipe, nvfp4_dit.calibrate(pipe, lambda: _generate(pipe), policy=BASE)


def test_calibration_gives_layers_of_different_error_different_precisions(forced):
    pipe, policy = forced
    got = _assignments(policy)
    layers = {"transformer.blocks.0.attn1", "transformer.blocks.1.attn1"}
    assert set(got) == {(layer, b) for layer in layers for b in ("first", "middle", "last")}  # cross-attention: none
    assert {got[("transformer.blocks.0.attn1", b)] for b in ("first", "middle", "last")} == {NVB}
    assert {got[("transformer.blocks.1.attn1", b)] for b in ("first", "middle", "last")} == {MXB}
    errs = {(e.layer, e.bucket): dict(e.errors) for e in policy.per_layer}
    b0, b1 = errs[("transformer.blocks.0.attn1", "middle")], errs[("transformer.blocks.1.attn1", "middle")]
    assert b0[NVB] < DEFAULT_BUDGET < b0[NV]
    assert b1[MXB] < DEFAULT_BUDGET < min(b1[NVB], b1[NV])
    # A tighter budget than 8-bit Q·Kᵀ reaches keeps the sharp layer exact.
    tight = errs_to_policy(policy, budget=0.5 * b1[MXB])
    assert {e.precision for e in tight.per_layer if e.layer == "transformer.blocks.1.attn1"} == {EXACT}
    assert policy.model_class == "WanTransformer3DModel" and policy.budget == DEFAULT_BUDGET
    assert policy.backend == "reference" and policy.dense_steps == BASE.dense_steps


def test_unmodified_model_calibrates_to_the_cheapest_fp4():
    pipe = _pipe()
    policy = nvfp4_dit.calibrate(pipe, lambda: _generate(pipe), policy=BASE, steps=[2, 3])
    assert set(_assignments(policy).values()) == {NV}
    assert {e.bucket for e in policy.per_layer} == {"middle"}  # only steps 2 and 3 measured


def test_auto_backend_measures_the_fp4_numerics_where_auto_runs_exact():
    # backend="auto" runs exact SDPA off sm_120 (here: no GPU); measured that way every error would
    # be 0 and every layer would look safe in FP4. The measurement takes the FP4 numerics instead,
    # and the saved policy keeps "auto" for the runs that follow.
    pipe = _pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = nvfp4_dit.calibrate(pipe, lambda: _generate(pipe), policy=BASE.replace(backend="auto"), steps=[2])
    assert policy.backend == "auto"
    errors = [err for e in policy.per_layer for _, err in e.errors]
    assert errors and min(errors) > 0.01
    assert measurement_policy(AttentionPolicy(backend="auto")).backend == "reference"
    assert measurement_policy(AttentionPolicy(backend="sdpa")).backend == "sdpa"


def test_calibration_run_is_the_exact_run_and_leaves_nothing_behind():
    pipe = _pipe()
    procs = {n: type(m.processor) for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")}
    torch.manual_seed(0)
    plain = _generate(pipe)
    out = {}
    torch.manual_seed(0)
    nvfp4_dit.calibrate(pipe, lambda: out.setdefault("latents", _generate(pipe)), policy=BASE)
    assert torch.equal(out["latents"], plain)
    assert routing._OBSERVERS == []
    assert {n: type(m.processor) for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")} == procs


def test_apply_follows_the_calibrated_policy(forced, tmp_path, monkeypatch):
    pipe, policy = forced
    path = tmp_path / "policy.json"
    policy.save(path)
    calls = []
    orig = ops.run_fp4

    def spy(q, k, v, **kw):
        calls.append((routing._STATE.layer, kw.get("balance_qk"), kw.get("qk_format")))
        return orig(q, k, v, **kw)

    monkeypatch.setattr(ops, "run_fp4", spy)
    with nvfp4_dit.apply(pipe, policy=str(path)) as handle:
        assert handle.policy == policy
        _generate(pipe)
    # Block 0 in NVFP4 with the balance, block 1 with MXFP8 Q·Kᵀ, on the middle steps (dense_steps
    # keeps the first and last step exact).
    assert set(calls) == {("transformer.blocks.0.attn1", True, "nvfp4"), ("transformer.blocks.1.attn1", True, "mxfp8")}
    assert len(calls) == 2 * 2 * (STEPS - 2)  # CFG: two forwards per step, two blocks


def test_a_policy_of_another_model_is_refused(forced):
    pipe, policy = forced
    with pytest.raises(ValueError, match="calibrated on WanTransformer3DModel, not on LTX"):
        nvfp4_dit.apply(build("ltx").model, policy=policy)
    with pytest.raises(ValueError, match="does not have"):
        nvfp4_dit.apply(pipe.transformer, policy=policy)  # bare model: names without "transformer."
    with pytest.raises(TypeError, match="either policy= or the policy arguments"):
        nvfp4_dit.apply(pipe, policy=policy, min_seq_len=0)
    with pytest.raises(TypeError, match="policy must be"):
        nvfp4_dit.apply(pipe, policy={"backend": "sdpa"})


def test_calibrate_rejects_bad_arguments_and_empty_runs():
    pipe = _pipe()
    with pytest.raises(ValueError, match="budget"):
        nvfp4_dit.calibrate(pipe, lambda: None, budget=0)
    with pytest.raises(ValueError, match="steps"):
        nvfp4_dit.calibrate(pipe, lambda: None, steps=[-1])
    with pytest.raises(TypeError, match="run must be"):
        nvfp4_dit.calibrate(pipe, "go")
    with pytest.raises(ValueError, match="no attention call"):
        nvfp4_dit.calibrate(pipe, lambda: _generate(pipe), policy=BASE.replace(min_seq_len=100_000))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_calibrates_and_applies(family):
    case = build(family)
    policy = nvfp4_dit.calibrate(case.model, case.run, policy=AttentionPolicy(backend="reference", min_seq_len=0))
    assert policy.per_layer and policy.model_class == type(case.model).__name__
    assert all(e.bucket == "middle" and len(e.errors) == 3 for e in policy.per_layer)  # bare model: step unknown
    seen = []

    def observe(info, q, k, v, out):
        seen.append((info.layer, info.path, policy.precision_for(info.layer, None)))

    routing.add_observer(observe)
    try:
        with nvfp4_dit.apply(case.model, policy=policy):
            case.run()
    finally:
        routing.remove_observer(observe)
    assert any(precision is not None for _, _, precision in seen)
    for layer, path, precision in seen:
        if precision is not None:
            assert (path == "fp4") == (not precision.exact), (layer, path, precision)


def test_calibration_with_keep_mass_measures_the_sparse_ladder(tmp_path):
    pipe = _pipe()
    base = BASE.replace(min_seq_len=0, keep_mass=0.9, sparse_off_steps=(0, 0), sparse_min_seq_len=0)
    policy = nvfp4_dit.calibrate(pipe, lambda: _generate(pipe), policy=base, steps=[2])
    entries = [e for e in policy.per_layer if not e.precision.exact]
    assert entries
    for e in entries:
        assert {(p, k) for p, k, _, _ in e.sparse_errors} == {(p, k) for p in FP4_PRECISIONS for k in KEEP_MASS_LADDER}
        assert e.keep_mass is not None and 0.0 < e.density <= 1.0
        assert all(0.0 < d <= 1.0 for *_, d in e.sparse_errors)
    path = tmp_path / "sparse.policy.json"
    policy.save(path)
    assert AttentionPolicy.load(path) == policy
