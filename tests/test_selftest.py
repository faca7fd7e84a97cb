"""The kernel's first-use self-test and ``python -m nvfp4_dit.selftest``.

CPU: the known-answer inputs really hold what the check relies on (exact zero means, e2m1 ties,
subnormal scales), the instruction case is laid out as the PTX model of tests/test_mma_model.py
reads it, the verdict logic (pending under graph capture, kept per kernel, skip variable), and
the command's CPU exit. GPU (``cuda``): the checks pass on this GPU's kernel, a forced mismatch
sends every later call to exact attention with one warning, CUDA-graph capture before and after
the first eager call.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess
from nvfp4_dit import diagnostics, selftest

try:
    from test_mma_model import mma, ptx_model
except ImportError:  # tests/ imported as a package
    from tests.test_mma_model import mma, ptx_model


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    selftest.reset()
    yield
    selftest.reset()


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------

E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.mark.parametrize("d", fmt.SUPPORTED_HEAD_DIMS)
def test_known_answer_inputs_have_exact_means_ties_and_subnormal_scales(d):
    q, k, v = selftest.known_answer_inputs(d, "cpu")
    assert q.shape == (1, selftest.KNOWN_ANSWER_TOKENS, 2, d) and k.shape == v.shape == (1, q.shape[1], 1, d)
    qq = preprocess.quantize_qkv(q, k, v, layout="NHD", balance_qk=True)
    for name in ("q_mean", "k_mean", "v_mean"):
        assert torch.count_nonzero(getattr(qq, name)) == 0, name
    # Reduction order cannot matter: the means of any token order are exactly zero as well.
    perm = torch.randperm(k.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.count_nonzero(preprocess.k_mean(fmt.to_hnd(k[:, perm], "NHD").double(), None)) == 0
    for name in ("q_sf", "k_sf", "vt_sf"):
        sf = getattr(qq, name)
        subnormal = int(((sf > 0) & (sf < 8)).sum())
        assert subnormal >= sf.numel() // 8, (name, subnormal)
    # The K codes: the scaled values sit on e2m1 rounding ties in every head.
    kh = fmt.to_hnd(k, "NHD").float() / qq.balance[:, :, None, :d] / qq.k_scale[:, :, None, None]
    sf_val = fmt.e4m3_decode(fmt.permute_k_rows(qq.k_sf, dim=2)).repeat_interleave(fmt.BLOCK, -1)[..., :d]
    ratio = (kh / sf_val).abs()
    ties = sum(int((ratio == t).sum()) for t in E2M1_TIES)
    assert ties >= ratio.numel() // 5, ties


@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 3])
def test_instruction_case_is_laid_out_as_the_ptx_model_reads_it(tid_a, tid_b):
    gen = torch.Generator().manual_seed(5)
    (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.nvfp4_probe_registers(gen, tid_a, tid_b, "cpu")
    d = mma(ptx_model(), a, b, sfa, sfb, c.double(), tid_a, tid_b)
    dense = a_val @ b_val.T + c_val
    assert torch.equal(selftest._unpack_d(d), dense)
    # Subnormal scales are in the case: operand values below e2m1's 0.5 times the least normal scale.
    for val in (a_val, b_val):
        assert ((val.abs() > 0) & (val.abs() < 0.5 * 2.0**-6)).any()


@pytest.mark.parametrize("tid_a, tid_b, byte_id", [(0, 0, 0), (1, 3, 2), (0, 2, 3)])
def test_8bit_instruction_case_is_laid_out_as_the_ptx_model_reads_it(tid_a, tid_b, byte_id):
    from test_mma_model import mma8, ptx_model8

    gen = torch.Generator().manual_seed(6)
    (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.mxfp8_probe_registers(gen, tid_a, tid_b, byte_id, "cpu")
    d = mma8(ptx_model8(), a, b, sfa, sfb, c.double(), tid_a, tid_b, byte_id)
    assert torch.equal(selftest._unpack_d(d), a_val @ b_val.T + c_val)


def test_a_batch_of_every_selector_combination_is_laid_out_as_the_ptx_models_read_it():
    # check_instruction builds all cases at once; each case's selectors must land in its own lanes.
    from test_mma_model import mma8, ptx_model8

    gen = torch.Generator().manual_seed(7)
    pairs = [(a, b) for a in range(2) for b in range(4)]
    (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.nvfp4_probe_cases(gen, pairs, "cpu")
    for i, (tid_a, tid_b) in enumerate(pairs):
        d = mma(ptx_model(), a[i], b[i], sfa[i], sfb[i], c[i].double(), tid_a, tid_b)
        assert torch.equal(selftest._unpack_d(d), a_val[i] @ b_val[i].T + c_val[i]), (tid_a, tid_b)
    triples = [(ta, tb, i) for ta, tb in pairs for i in range(4)]
    (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.mxfp8_probe_cases(gen, triples, "cpu")
    for i, sel in enumerate(triples):
        d = mma8(ptx_model8(), a[i], b[i], sfa[i], sfb[i], c[i].double(), *sel)
        assert torch.equal(selftest._unpack_d(d), a_val[i] @ b_val[i].T + c_val[i]), sel


def _model_probes(monkeypatch):
    """The kernel's MMA probes replaced by the PTX models (CPU), as check_instruction calls them."""
    from test_mma_model import mma8, ptx_model8

    from nvfp4_dit.cuda import launch as kernels

    def unsigned(*regs):
        return [r.long() & 0xFFFFFFFF for r in regs]

    monkeypatch.setattr(kernels, "mma_nvfp4_probe", lambda a, b, sfa, sfb, c, ta, tb, native: mma(
        ptx_model(), *unsigned(a, b, sfa, sfb), c.double(), ta, tb).float())
    monkeypatch.setattr(kernels, "mma_mxfp8_probe", lambda a, b, sfa, sfb, c, ta, tb, i, native: mma8(
        ptx_model8(), *unsigned(a, b, sfa, sfb), c.double(), ta, tb, i).float())


def test_instruction_check_passes_on_the_ptx_models_and_names_a_swapped_scale_pair(monkeypatch):
    _model_probes(monkeypatch)
    assert selftest.check_instruction("cpu", True, "nvfp4") == (True, "8 selector combinations within the "
                                                                      "accumulation bound")
    ok, detail = selftest.check_instruction("cpu", True, "mxfp8")
    assert ok and detail.startswith("40 selector combinations"), detail
    monkeypatch.setattr(selftest, "nvfp4_probe_cases", _swap_scale_pair(selftest.nvfp4_probe_cases))
    ok, detail = selftest.check_instruction("cpu", True, "nvfp4")
    assert not ok and "nvfp4 thread-id-a" in detail and "accumulation bound" in detail, detail


def _fake_checks(ok):
    return (selftest.Check("instruction", True, "fine"), selftest.Check("quantiser", ok, "k_sf differs in 3 of 9"),
            selftest.Check("attention", True, "fine"))


def _fake_key(device, head_dim, qk_format="nvfp4"):
    return selftest.KernelKey(0, "sm_120a", fmt.padded_head_dim(head_dim), qk_format, "native")


def test_verdict_is_reached_once_per_kernel_and_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(selftest, "kernel_key", _fake_key)
    monkeypatch.setattr(selftest, "run_checks", lambda dev, d, f: calls.append(d) or _fake_checks(True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for _ in range(3):
        assert selftest.fallback_reason(torch.device("cuda", 0), 128) is None
        assert selftest.fallback_reason(torch.device("cuda", 0), 80) is None   # padded to 128: same kernel
        assert selftest.fallback_reason(torch.device("cuda", 0), 64) is None
    assert calls == [128, 64]
    assert len(selftest.verdicts()) == 2 and all(v.ok for v in selftest.verdicts().values())


def test_failed_verdict_names_the_gpu_what_differed_and_how_to_report(monkeypatch):
    monkeypatch.setattr(selftest, "kernel_key", _fake_key)
    monkeypatch.setattr(selftest, "run_checks", lambda dev, d, f: _fake_checks(False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(selftest, "environment", lambda device=None: {"gpu": "NVIDIA GeForce RTX 5090",
                                                                       "driver": "580.65", "torch_cuda": "12.8"})
    reason = selftest.fallback_reason(torch.device("cuda", 0), 128)
    assert "RTX 5090" in reason and "driver 580.65" in reason and "sm_120a" in reason
    assert "quantiser: k_sf differs in 3 of 9" in reason and "instruction" not in reason
    assert "python -m nvfp4_dit.selftest" in reason and "Exact attention runs instead" in reason
    assert selftest.fallback_reason(torch.device("cuda", 0), 128) == reason


def test_pending_verdict_during_graph_capture_takes_the_exact_path(monkeypatch):
    calls = []
    monkeypatch.setattr(selftest, "kernel_key", _fake_key)
    monkeypatch.setattr(selftest, "run_checks", lambda dev, d, f: calls.append(d) or _fake_checks(True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    reason = selftest.fallback_reason(torch.device("cuda", 0), 64)
    assert "graph capture" in reason and "nvfp4_dit.selftest.verify()" in reason
    assert calls == [] and selftest.verdicts() == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert selftest.fallback_reason(torch.device("cuda", 0), 64) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert selftest.fallback_reason(torch.device("cuda", 0), 64) is None   # the verdict stands in capture
    assert calls == [64]


def test_skip_variable(monkeypatch):
    monkeypatch.setattr(selftest, "run_checks", lambda *a: pytest.fail("the self-test must not run"))
    monkeypatch.setenv(selftest.SKIP_ENV, "1")
    assert selftest.fallback_reason(torch.device("cuda", 0), 64) is None
    monkeypatch.setenv(selftest.SKIP_ENV, "0")
    assert not selftest.skipped()


def test_a_check_that_raises_fails_instead_of_crashing(monkeypatch):
    def boom(*args):
        raise RuntimeError("illegal instruction")

    monkeypatch.setattr(selftest, "check_instruction", boom)
    monkeypatch.setattr(selftest, "check_quantiser", lambda *a: (True, "ok"))
    monkeypatch.setattr(selftest, "check_attention", lambda *a: (True, "ok"))
    monkeypatch.setattr(torch.cuda, "device", lambda d: torch.no_grad())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (12, 0))
    checks = selftest.run_checks(torch.device("cpu"), 64)
    assert [c.ok for c in checks] == [False, True, True]
    assert "RuntimeError: illegal instruction" in checks[0].detail


def test_command_exits_with_a_clear_message_without_a_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert diagnostics.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "backend='reference'" in err
    assert not list(tmp_path.iterdir())


def test_command_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        diagnostics.main(["--speed-seqs", "8k"])
    assert "--speed-seqs" in capsys.readouterr().err


def test_markdown_report_shows_every_section():
    report = {"environment": {"gpu": "X", "driver": "1"}, "note": "emulated", "passed": False,
              "known_answer": [{"head_dim": 64, "qk_format": "nvfp4", "seconds": 0.01, "checks": [
                  {"name": "quantiser", "ok": False, "detail": "k_sf differs"}]}],
              "long_sequence": [{"seq": 77000, "heads": 2, "head_dim": 128, "qk_format": "mxfp8", "rows": 768,
                                 "cos_vs_reference": 0.99995, "max_lse_error_vs_reference": 0.0004,
                                 "mean_cos_vs_exact": 0.96, "finite": True, "ok": True}],
              "speed": [{"seq": 8192, "heads": 24, "head_dim": 128, "impl": "nvfp4_dit", "ms": 1.0, "tflops": 100.0,
                         "vs_best_sdpa": 2.0},
                        {"seq": 8192, "heads": 24, "head_dim": 128, "impl": "FlashInfer", "error": "ImportError"}]}
    md = diagnostics._markdown(report)
    for text in ("| 64 | nvfp4 | quantiser | FAILED | k_sf differs", "| 77000 | 2 | 128 | mxfp8 | 768 | 0.99995 | 0.0004 | 0.96 | True | ok |", "| nvfp4_dit | 1.0 | 100.0 | 2.0 |",
                 "ImportError", "Result: **FAIL**", "emulated"):
        assert text in md, text
    json.dumps(report)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("qk_format", fmt.QK_FORMATS)
def test_selftest_passes_on_this_gpu(cuda_device, qk_format):
    for verdict in selftest.verify(cuda_device, qk_format=qk_format):
        print(f"D={verdict.key.head_dim} {qk_format} {verdict.key.arch} {verdict.key.mma}: "
              f"{verdict.seconds * 1e3:.1f} ms; " + "; ".join(f"{c.name}: {c.detail}" for c in verdict.checks))
        assert verdict.ok, verdict.checks


def _swap_scale_pair(real):
    def wrong(gen, selectors, device):
        (a, b, sfa, sfb, c), vals = real(gen, selectors, device)
        swapped = sfa.clone()
        for i, (tid_a, _) in enumerate(selectors):   # a hardware reading rows g and g+8's scales swapped
            lanes = torch.arange(8, device=sfa.device) * 4 + 2 * tid_a
            swapped[i, lanes], swapped[i, lanes + 1] = sfa[i, lanes + 1], sfa[i, lanes]
        return (a, b, swapped, sfb, c), vals
    return wrong


def _ties_away_from_zero(real):
    def wrong(x):
        codes = real(x)
        a = x.float().abs()
        up = (a == 0.25) | (a == 1.25) | (a == 2.5)   # ties the hardware would round the other way
        return torch.where(up, codes + 1, codes).to(torch.uint8)
    return wrong


@pytest.mark.cuda
@pytest.mark.parametrize("mismatch", ["scale_pair", "e2m1_ties"])
def test_forced_mismatch_runs_exact_attention_with_one_warning(cuda_device, monkeypatch, mismatch):
    if mismatch == "scale_pair":
        monkeypatch.setattr(selftest, "nvfp4_probe_cases", _swap_scale_pair(selftest.nvfp4_probe_cases))
        failing = "instruction"
    else:
        monkeypatch.setattr(fmt, "e2m1_encode", _ties_away_from_zero(fmt.e2m1_encode))
        failing = "quantiser"
    runs = []
    real_checks = selftest.run_checks
    monkeypatch.setattr(selftest, "run_checks", lambda *a: runs.append(a) or real_checks(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 512, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    with pytest.warns(nvfp4_dit.FallbackWarning) as caught:
        out = nvfp4_dit.attention(q, k, v, backend="cuda")
    messages = [str(w.message) for w in caught if issubclass(w.category, nvfp4_dit.FallbackWarning)]
    assert len(messages) == 1
    print(messages[0])
    assert torch.cuda.get_device_name() in messages[0] and "driver" in messages[0]
    assert f"{failing}:" in messages[0] and "python -m nvfp4_dit.selftest" in messages[0]
    exact = nvfp4_dit.attention(q, k, v, backend="sdpa")
    assert torch.equal(out, exact)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no second warning
        again = nvfp4_dit.attention(q, k, v, backend="cuda", causal=True)
    assert torch.equal(again, nvfp4_dit.attention(q, k, v, backend="sdpa", causal=True))
    assert len(runs) == 1
    monkeypatch.undo()
    selftest.reset()
    assert all(v.ok for v in selftest.verify(cuda_device, head_dims=(128,)))


@pytest.mark.cuda
def test_cuda_graph_capture_before_and_after_the_first_eager_call(cuda_device):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 1024, 4, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    exact = nvfp4_dit.attention(q, k, v, backend="sdpa")
    # Before any eager FP4 call the self-test cannot run inside the capture: exact attention.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nvfp4_dit.attention(q, k, v, backend="sdpa")   # warm-up of the exact path outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(nvfp4_dit.FallbackWarning, match="graph capture"):
        with torch.cuda.graph(graph):
            captured = nvfp4_dit.attention(q, k, v, backend="cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, exact)
    assert selftest.verdicts() == {}
    # One eager call runs the self-test; a capture after it records the FP4 kernel.
    eager = nvfp4_dit.attention(q, k, v, backend="cuda")
    assert len(selftest.verdicts()) == 1
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        captured2 = nvfp4_dit.attention(q, k, v, backend="cuda")
    graph2.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured2, eager)


@pytest.mark.cuda
def test_command_passes_and_reports_every_section_on_this_gpu(cuda_device, tmp_path, capsys):
    # A short run of the whole command: known answers for each format, the long-sequence check
    # (first, middle, last Q blocks against the reference), one speed row per peer.
    assert diagnostics.main(["--out", str(tmp_path), "--long-seq", "9000", "--speed-seqs", "1024", "--reps", "1"]) == 0
    print(capsys.readouterr().out)
    report = json.loads((tmp_path / "nvfp4_dit_selftest.json").read_text())
    assert report["passed"] and report["environment"]["cuda_driver_api"] != "unknown"
    assert [r["qk_format"] for r in report["long_sequence"]] == list(fmt.QK_FORMATS)
    for r in report["long_sequence"]:
        # the last block holds the 9000 - 70 * 128 = 40 rows past the final full block
        assert r["ok"] and r["rows"] == (2 * 128 + 40) * r["heads"] and r["cos_vs_reference"] >= diagnostics.LONG_MIN_COS
    md = (tmp_path / "nvfp4_dit_selftest.md").read_text()
    assert "| 9000 | 2 | 128 | mxfp8 |" in md and "## Speed" in md and "Result: **PASS**" in md
