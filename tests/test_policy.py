"""nvfp4_dit.policy: the one NVFP4 / exact policy of the diffusers processors and the ComfyUI node."""

import pytest

import nvfp4_dit
from nvfp4_dit.policy import DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ_LEN, AttentionPolicy


def test_defaults_are_shared_by_both_integrations():
    p = AttentionPolicy()
    assert (p.backend, p.self_attention, p.cross_attention) == ("auto", True, False)
    assert p.dense_steps == DEFAULT_DENSE_STEPS == (1, 1) and p.min_seq_len == DEFAULT_MIN_SEQ_LEN == 1024
    import inspect

    from nvfp4_dit.processors import apply

    for fn in (nvfp4_dit.apply, apply):
        params = inspect.signature(fn).parameters
        assert params["dense_steps"].default == p.dense_steps and params["min_seq_len"].default == p.min_seq_len
        assert params["cross_attention"].default is p.cross_attention
        assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in params if n != "pipe_or_model")


@pytest.mark.parametrize("kwargs, reason", [
    (dict(cross=False, seq_q=4096, seq_k=4096), None),
    (dict(cross=True, seq_q=4096, seq_k=4096), "cross-attention"),
    (dict(cross=False, seq_q=4096, seq_k=512), "short sequence"),   # min(Sq, Sk) counts
    (dict(cross=False, seq_q=512, seq_k=4096), "short sequence"),
    (dict(step=(0, 30)), "dense step"), (dict(step=(29, 30)), "dense step"), (dict(step=(1, 30)), None),
    (dict(step=None), None),  # an unknown step is not dense
    (dict(), None),           # nothing known, nothing checked
])
def test_dense_reason(kwargs, reason):
    assert AttentionPolicy().dense_reason(**kwargs) == reason


def test_roles_and_steps_follow_the_settings():
    p = AttentionPolicy(self_attention=False, cross_attention=True, dense_steps=(0, 2), min_seq_len=0)
    assert p.dense_reason(cross=False) == "self-attention" and p.dense_reason(cross=True) is None
    assert [p.step_is_dense((i, 5)) for i in range(5)] == [False, False, False, True, True]
    assert p.replace(dense_steps=None).dense_steps == (0, 0)


def test_layers_allow_list():
    p = AttentionPolicy(layers=["blocks.*.attn1", 3])
    assert p.layers == ("blocks.*.attn1", 3)
    assert p.layer_allowed("blocks.0.attn1") and p.layer_allowed("transformer.blocks.7.attn1")
    assert p.layer_allowed("transformer_blocks.3.attn") and not p.layer_allowed("blocks.0.attn2")
    assert not p.layer_allowed(None) and AttentionPolicy().layer_allowed(None)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(backend="fp4"), ValueError, "backend"), (dict(self_attention="yes"), TypeError, "self_attention"),
    (dict(cross_attention=1), TypeError, "cross_attention"), (dict(dense_steps=(1,)), ValueError, "dense_steps"),
    (dict(dense_steps=(-1, 0)), ValueError, "dense_steps"), (dict(min_seq_len=-1), ValueError, "min_seq_len"),
    (dict(min_seq_len=True), ValueError, "min_seq_len"), (dict(layers=[-3]), ValueError, "layers"),
    (dict(layers=[1.5]), TypeError, "layers"), (dict(keep_mass=0.0), ValueError, "keep_mass"),
    (dict(keep_mass=1.5), ValueError, "keep_mass"), (dict(keep_mass="0.9"), TypeError, "keep_mass"),
    (dict(keep_mass=True), TypeError, "keep_mass"), (dict(sparse_off_steps=(1,)), ValueError, "sparse_off_steps"),
    (dict(sparse_min_seq_len=-1), ValueError, "sparse_min_seq_len"),
])
def test_bad_settings_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionPolicy(**kwargs)


def test_policy_is_immutable_and_holds_no_state():
    p = AttentionPolicy()
    with pytest.raises(Exception):
        p.min_seq_len = 0  # frozen: processors of one apply() share it
    assert p == AttentionPolicy() and hash(p) == hash(AttentionPolicy())


def test_keep_mass_rules_and_the_saved_file(tmp_path):
    p = AttentionPolicy(keep_mass=0.9, sparse_off_steps=(2, 1), sparse_min_seq_len=1000)
    assert p.keep_mass_for((5, 10), 4096, 4096) == 0.9 and p.keep_mass_for(None, 4096, 4096) == 0.9
    assert p.keep_mass_for((1, 10), 4096, 4096) is None and p.keep_mass_for((9, 10), 4096, 4096) is None
    assert p.keep_mass_for((5, 10), 999, 4096) is None
    assert AttentionPolicy().keep_mass_for((5, 10), 1 << 20, 1 << 20) is None            # dense by default
    assert AttentionPolicy(keep_mass=1.0, sparse_min_seq_len=0).keep_mass_for((5, 10), 10, 10) is None
    assert "keep_mass 0.9" in p.describe()
    path = tmp_path / "sparse.json"
    p.save(path)
    assert AttentionPolicy.load(path) == p
