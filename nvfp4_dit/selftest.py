"""The CUDA kernel's first-use self-test: a known-answer check before its first use on a GPU.

The first FP4 call per (GPU, arch, head dim, Q·Kᵀ format, MMA kind) in a process
runs three known-answer checks on the kernel it is about to use, against the reference numerics
(:mod:`nvfp4_dit.format`, :mod:`nvfp4_dit.reference`):

* *instruction*: one block-scaled MMA per legal scale-selector pair, on random registers with
  subnormal ue4m3 scales, against a dense fp64 product (products are exact; the bound leaves
  2^-12 of the magnitude sum for the accumulation, which the PTX ISA does not specify);
* *quantiser*: the CUDA quantiser on 256 tokens built so that every mean and sum is exact, with
  e2m1 rounding ties in every block and subnormal block scales, byte for byte against
  :func:`nvfp4_dit.preprocess.quantize_qkv`;
* *attention*: the kernel on those inputs against :func:`nvfp4_dit.reference.attention_reference`
  (cosine >= 0.9995, LSE within 5e-3).

If any differs, every later FP4 call of that kind in the process runs exact attention, with one
warning naming the GPU, the driver and what differed. The verdict is the only state the FP4 path
keeps between calls. The check needs a synchronising compare, so it never runs during CUDA-graph
capture: there the call runs exact attention until an eager call (or :func:`verify`) has run it.
``NVFP4_DIT_SKIP_SELFTEST=1`` skips it.

``python -m nvfp4_dit.selftest`` runs these checks and more and writes a report to attach to a bug
report (:mod:`nvfp4_dit.diagnostics`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time
from typing import Optional, Sequence

import torch

from . import format as fmt
from . import preprocess
from .diagnostics import REPORT_FILES, environment

SKIP_ENV = "NVFP4_DIT_SKIP_SELFTEST"
HOW_TO_REPORT = (f"please run `python -m nvfp4_dit.selftest` and attach the two files it writes "
                 f"({REPORT_FILES[0]}, {REPORT_FILES[1]}) to a bug report")

# Known-answer sizes: a few hundred tokens, GQA (2 query heads on 1 KV head).
KNOWN_ANSWER_TOKENS = 256
KNOWN_ANSWER_HEADS = (2, 1)
ATTENTION_MIN_COS = 0.9995
ATTENTION_MAX_LSE_ERROR = 5e-3
MMA_ACCUMULATION_BOUND = 2.0**-12


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """What one verdict covers."""

    device_index: int
    arch: str             # the build target, e.g. "sm_120a"
    head_dim: int         # the kernel's (padded) head dim
    qk_format: str
    mma: str              # "native" or "emulated"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    key: KernelKey
    checks: tuple[Check, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failure_message(self, device: torch.device) -> str:
        env = environment(device)
        differed = "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)
        return (f"the FP4 kernel failed its first-use self-test on {env['gpu']} ({self.key.arch}, "
                f"{self.key.mma} MMA, driver {env['driver']}, CUDA {env['torch_cuda']}), head dim "
                f"{self.key.head_dim}, Q·Kᵀ {self.key.qk_format}: {differed}. Exact attention runs instead "
                f"for the rest of this process; {HOW_TO_REPORT}")


# The one piece of per-process state of the FP4 path.
_verdicts: dict[KernelKey, Verdict] = {}
_lock = threading.Lock()


def reset() -> None:
    """Forget every verdict: the next FP4 call checks again (tests, long-lived servers after a
    driver update)."""
    from .planner import forget_resolved

    with _lock:
        _verdicts.clear()
    forget_resolved()


def verdicts() -> dict[KernelKey, Verdict]:
    """The verdicts reached so far in this process."""
    with _lock:
        return dict(_verdicts)


def kernel_key(device: torch.device, head_dim: int, qk_format: str = "nvfp4") -> KernelKey:
    from .cuda import build

    index = build.device_index(device)
    cc = build.device_capability(index)
    padded = fmt.padded_head_dim(head_dim)
    if padded is None:
        raise ValueError(f"head_dim {head_dim} is not supported (at most {fmt.SUPPORTED_HEAD_DIMS[-1]})")
    if qk_format not in fmt.QK_FORMATS:
        raise ValueError(f"qk_format must be one of {fmt.QK_FORMATS}, got {qk_format!r}")
    return KernelKey(index, build.arch_for_capability(*cc), padded, qk_format, build.mma_kind(cc) or "none")


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "").strip() not in ("", "0")


def fallback_reason(device: torch.device, head_dim: int, qk_format: str = "nvfp4") -> Optional[str]:
    """None when the kernel may run this call; else why exact attention must run instead (the
    self-test failed, or it is pending and cannot run now). Runs the self-test on first use."""
    if skipped():
        return None
    key = kernel_key(device, head_dim, qk_format)
    with _lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        if torch.cuda.is_current_stream_capturing():
            return ("the FP4 kernel's first-use self-test has not run in this process and cannot run during "
                    "CUDA graph capture; run one eager call (or nvfp4_dit.selftest.verify()) before capturing")
        verdict = _verify_key(key)
    return None if verdict.ok else verdict.failure_message(torch.device("cuda", key.device_index))


def verify(device=None, head_dims: Sequence[int] = fmt.SUPPORTED_HEAD_DIMS, qk_format: str = "nvfp4") -> list[Verdict]:
    """Run the first-use self-test now for ``head_dims`` on ``device`` (default: the current GPU),
    e.g. before capturing a CUDA graph; a verdict already reached in this process is returned as
    it is."""
    if not torch.cuda.is_available():
        raise RuntimeError("the self-test needs a CUDA GPU")
    device = torch.device("cuda") if device is None else torch.device(device)
    return [_verify_key(kernel_key(device, d, qk_format)) for d in head_dims]


def _verify_key(key: KernelKey) -> Verdict:
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
        device = torch.device("cuda", key.device_index)
        start = time.perf_counter()
        checks = run_checks(device, key.head_dim, key.qk_format)
        verdict = Verdict(key, checks, time.perf_counter() - start)
        _verdicts[key] = verdict
        return verdict


# ---------------------------------------------------------------------------------------------
# The known-answer checks
# ---------------------------------------------------------------------------------------------

def run_checks(device: torch.device, head_dim: int, qk_format: str = "nvfp4") -> tuple[Check, ...]:
    """The three known-answer checks of the kernel for ``device`` and ``head_dim``. A check that
    raises counts as failed (its exception is the detail)."""
    from .cuda import build

    if qk_format not in fmt.QK_FORMATS:
        raise ValueError(f"qk_format must be one of {fmt.QK_FORMATS}, got {qk_format!r}")
    native = build.is_native(torch.cuda.get_device_capability(device))
    checks = []
    with torch.no_grad(), torch.cuda.device(device):
        q, k, v = known_answer_inputs(head_dim, device)
        for name, fn in (("instruction", lambda: check_instruction(device, native, qk_format)),
                         ("quantiser", lambda: check_quantiser(q, k, v, qk_format)),
                         ("attention", lambda: check_attention(q, k, v, qk_format))):
            try:
                ok, detail = fn()
            except Exception as exc:  # noqa: BLE001 - a crash is a failed check, never a crash of the caller
                ok, detail = False, f"raised {type(exc).__name__}: {exc}"
            checks.append(Check(name, ok, detail))
    return tuple(checks)


def _pack8(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibble codes -> int64 words, element i in bits [4i+3:4i]."""
    return (codes.long() << (torch.arange(8, device=codes.device) * 4)).sum(-1)


def _word(bytes4: torch.Tensor) -> torch.Tensor:
    return (bytes4.long() << (torch.arange(4, device=bytes4.device) * 8)).sum(-1)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).contiguous()


def _ab_registers(a_codes: torch.Tensor, b_codes: torch.Tensor, per_reg: int, pack) -> tuple[torch.Tensor, torch.Tensor]:
    """A codes [n, 16, K] and B codes [n, 8, K] -> the A [n, 32, 4] and B [n, 32, 2] registers of
    an m16n8 MMA (PTX fragment tables): lane 4g + t holds k = per_reg * t + i of rows g and g + 8 of
    A (of column g of B) in its first registers, and the same at K/2 + k in the next; ``pack`` packs
    the ``per_reg`` codes of one register."""
    lanes = torch.arange(32, device=a_codes.device)
    g, t = (lanes // 4)[:, None], lanes % 4
    ks = per_reg * t[:, None] + torch.arange(per_reg, device=a_codes.device)
    half = a_codes.shape[-1] // 2
    a = torch.stack([pack(a_codes[:, g, ks]), pack(a_codes[:, g + 8, ks]),
                     pack(a_codes[:, g, half + ks]), pack(a_codes[:, g + 8, half + ks])], -1)
    b = torch.stack([pack(b_codes[:, g, ks]), pack(b_codes[:, g, half + ks])], -1)
    return a, b


def nvfp4_probe_cases(gen: torch.Generator, selectors: Sequence[tuple[int, int]], device):
    """Registers of one m16n8k64 block-scaled FP4 MMA per (thread-id-a, thread-id-b) of
    ``selectors``, laid out by the PTX fragment tables, and the dense fp64 operands they encode,
    each stacked along a leading case dimension. Returns (a [n, 32, 4], b [n, 32, 2], sfa, sfb
    [n, 32], c [n, 32, 4] registers; a_val [n, 16, 64], b_val [n, 8, 64], c [n, 16, 8])."""
    n = len(selectors)
    tid_a = torch.tensor([s[0] for s in selectors], device=device)[:, None]
    tid_b = torch.tensor([s[1] for s in selectors], device=device)[:, None]
    a_codes = torch.randint(0, 16, (n, 16, 64), generator=gen, device=device)
    b_codes = torch.randint(0, 16, (n, 8, 64), generator=gen, device=device)
    # Scale bytes across the ue4m3 range, subnormals (0x01..0x07) included, never NaN (0x7F).
    sfa = torch.randint(0x01, 0x7F, (n, 16, 4), generator=gen, device=device)
    sfb = torch.randint(0x01, 0x7F, (n, 8, 4), generator=gen, device=device)
    sfa[:, ::3, 1] = torch.randint(0x01, 0x08, sfa[:, ::3, 1].shape, generator=gen, device=device)
    sfb[:, ::2, 2] = torch.randint(0x01, 0x08, sfb[:, ::2, 2].shape, generator=gen, device=device)
    c = torch.randn(n, 16, 8, generator=gen, device=device)
    a_reg, b_reg = _ab_registers(a_codes, b_codes, 8, _pack8)
    # Lanes the selectors do not name hold garbage: the MMA must ignore them.
    sfa_reg = torch.randint(0, 2**32, (n, 32), generator=gen, device=device)
    sfb_reg = torch.randint(0, 2**32, (n, 32), generator=gen, device=device)
    case = torch.arange(n, device=device)[:, None]
    rows = torch.arange(8, device=device)
    sfa_reg[case, 4 * rows + 2 * tid_a] = _word(sfa[:, rows])
    sfa_reg[case, 4 * rows + 2 * tid_a + 1] = _word(sfa[:, rows + 8])
    sfb_reg[case, 4 * rows + tid_b] = _word(sfb[:, rows])
    a_val = fmt.e2m1_decode(a_codes.to(torch.uint8)).double() * \
        fmt.e4m3_decode(sfa.to(torch.uint8)).double().repeat_interleave(16, -1)
    b_val = fmt.e2m1_decode(b_codes.to(torch.uint8)).double() * \
        fmt.e4m3_decode(sfb.to(torch.uint8)).double().repeat_interleave(16, -1)
    return (a_reg, b_reg, sfa_reg, sfb_reg, _pack_cd(c)), (a_val, b_val, c.double())


def mxfp8_probe_cases(gen: torch.Generator, selectors: Sequence[tuple[int, int, int]], device):
    """The same for one m16n8k32 kind::mxf8f6f4 MMA (e4m3, ue8m0 scale_vec::1X) per (thread-id-a,
    thread-id-b, byte-id): byte i of a register holds k = 4t + i; a0/a1 rows g/g+8 at k, a2/a3 at
    16 + k; b0/b1 column g at k and 16 + k; the scale of each row / column sits in byte ``byte-id``
    of the lane the selectors name."""
    n = len(selectors)
    tid_a, tid_b, byte_id = (torch.tensor([s[i] for s in selectors], device=device)[:, None] for i in range(3))

    def e4m3_codes(rows):
        codes = torch.randint(0, 256, (n, rows, 32), generator=gen, device=device)
        return torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)   # never NaN
    a_codes, b_codes = e4m3_codes(16), e4m3_codes(8)
    sfa = torch.randint(127 - 20, 127 + 20, (n, 16), generator=gen, device=device)
    sfb = torch.randint(127 - 20, 127 + 20, (n, 8), generator=gen, device=device)
    c = torch.randn(n, 16, 8, generator=gen, device=device)
    a_reg, b_reg = _ab_registers(a_codes, b_codes, 4, _word)
    sfa_reg = torch.randint(0, 2**32, (n, 32), generator=gen, device=device)
    sfb_reg = torch.randint(0, 2**32, (n, 32), generator=gen, device=device)
    shift = 8 * byte_id
    keep = ~(0xFF << shift) & 0xFFFFFFFF
    case = torch.arange(n, device=device)[:, None]
    rows = torch.arange(8, device=device)

    def put(reg, lanes, value):   # the scale byte into byte byte-id of those lanes
        reg[case, lanes] = (reg[case, lanes] & keep) | (value << shift)

    put(sfa_reg, 4 * rows + 2 * tid_a, sfa[:, rows])
    put(sfa_reg, 4 * rows + 2 * tid_a + 1, sfa[:, rows + 8])
    put(sfb_reg, 4 * rows + tid_b, sfb[:, rows])
    a_val = fmt.e4m3_decode(a_codes.to(torch.uint8)).double() * fmt.ue8m0_decode(sfa).double()[..., None]
    b_val = fmt.e4m3_decode(b_codes.to(torch.uint8)).double() * fmt.ue8m0_decode(sfb).double()[..., None]
    return (a_reg, b_reg, sfa_reg, sfb_reg, _pack_cd(c)), (a_val, b_val, c.double())


def _first_case(cases):
    registers, values = cases
    return tuple(r[0] for r in registers), tuple(v[0] for v in values)


def nvfp4_probe_registers(gen: torch.Generator, tid_a: int, tid_b: int, device):
    """One case of :func:`nvfp4_probe_cases`: registers a [32, 4], b [32, 2], sfa, sfb [32], c [32, 4];
    a_val [16, 64], b_val [8, 64], c [16, 8]."""
    return _first_case(nvfp4_probe_cases(gen, [(tid_a, tid_b)], device))


def mxfp8_probe_registers(gen: torch.Generator, tid_a: int, tid_b: int, byte_id: int, device):
    """One case of :func:`mxfp8_probe_cases`, shaped as :func:`nvfp4_probe_registers`."""
    return _first_case(mxfp8_probe_cases(gen, [(tid_a, tid_b, byte_id)], device))


def _pack_cd(c: torch.Tensor) -> torch.Tensor:
    """[..., 16, 8] -> the C/D registers [..., 32 lanes, 4] of an m16n8 MMA (the inverse of _unpack_d)."""
    lanes = torch.arange(32, device=c.device)
    g, t = lanes // 4, lanes % 4
    return torch.stack([c[..., g, 2 * t], c[..., g, 2 * t + 1], c[..., g + 8, 2 * t], c[..., g + 8, 2 * t + 1]], -1)


def _unpack_d(d_reg: torch.Tensor) -> torch.Tensor:
    """[..., 32 lanes, 4] D registers -> [..., 16, 8] fp64."""
    lanes = torch.arange(32, device=d_reg.device)
    g, t = lanes // 4, lanes % 4
    d = torch.empty(*d_reg.shape[:-2], 16, 8, dtype=torch.float64, device=d_reg.device)
    d[..., g, 2 * t], d[..., g, 2 * t + 1] = d_reg[..., 0].double(), d_reg[..., 1].double()
    d[..., g + 8, 2 * t], d[..., g + 8, 2 * t + 1] = d_reg[..., 2].double(), d_reg[..., 3].double()
    return d


def check_instruction(device, native: bool, qk_format: str = "nvfp4") -> tuple[bool, str]:
    """One MMA per legal selector combination against a dense product: the FP4 MMA (8 pairs),
    and for ``qk_format="mxfp8"`` also the 8-bit one (32: pairs x byte-id). Every case is built on
    the host at once, copied over once, and the results come back in one copy: a round trip to the
    GPU per combination would cost more than the MMAs."""
    from .cuda import launch as kernels

    gen = torch.Generator().manual_seed(2024)
    pairs = [(a, b) for a in range(2) for b in range(4)]
    groups = [("nvfp4", pairs, nvfp4_probe_cases(gen, pairs, "cpu"), kernels.mma_nvfp4_probe)]
    if qk_format == "mxfp8":
        triples = [(a, b, i) for a, b in pairs for i in range(4)]
        groups.append(("mxfp8", triples, mxfp8_probe_cases(gen, triples, "cpu"), kernels.mma_mxfp8_probe))
    worst, where, count = 0.0, "", 0
    for kind, selectors, (registers, (a_val, b_val, c_val)), probe in groups:
        a, b, sfa, sfb = (_as_int32(r).to(device) for r in registers[:4])
        c = registers[4].contiguous().to(device)
        d = _unpack_d(torch.stack([probe(a[i], b[i], sfa[i], sfb[i], c[i], *sel, native)
                                   for i, sel in enumerate(selectors)]).cpu())
        dense = a_val @ b_val.transpose(1, 2) + c_val
        magnitude = a_val.abs() @ b_val.abs().transpose(1, 2) + c_val.abs()
        excess = ((d - dense).abs() / (magnitude * MMA_ACCUMULATION_BOUND + 1e-30)).flatten(1).amax(1)
        excess = excess.nan_to_num(nan=math.inf)
        i = int(excess.argmax())
        count += len(selectors)
        if excess[i].item() > worst:
            worst = excess[i].item()
            rel = ((d[i] - dense[i]).norm() / dense[i].norm()).item()
            named = zip(("thread-id-a", "thread-id-b", "byte-id"), selectors[i])
            where = f"{kind} " + ", ".join(f"{n} {v}" for n, v in named) + f": relative error {rel:.3g}"
    ok = worst <= 1.0
    return ok, (f"{count} selector combinations within the accumulation bound" if ok else
                f"MMA result off by {worst:.3g}x the accumulation bound ({where})")


def known_answer_inputs(head_dim: int, device, seed: int = 0):
    """q [1, S, 2, D], k, v [1, S, 1, D] bf16 (NHD) whose FP4 quantisation is a known answer.

    Every channel holds multiples of 2^(e-2) up to 6 * 2^e, with e per 16-channel group (0 for
    most, down to -17 for some), and the tokens come in +- pairs (per 128-row Q block for Q), so
    every mean is exactly 0 and every sum exact in any order: the quantised bytes do not depend on
    reduction order. Every 16-element block holds a +-6 * 2^e, so its scale is an exact power of
    two and the codes of the other values land on e2m1 rounding ties (0.25, 0.75, ..., 5) or
    exact values; the tiny groups give subnormal ue4m3 block scales."""
    d = head_dim
    gen = torch.Generator(device="cpu").manual_seed(1000 + seed + d)
    exps = torch.tensor([0, -15, -3, -16, 0, -17, -1, -14])[: d // fmt.BLOCK]
    channel_exp = exps.repeat_interleave(fmt.BLOCK)[:d]
    s, (h, hkv) = KNOWN_ANSWER_TOKENS, KNOWN_ANSWER_HEADS
    half = s // 2

    def tensor(heads: int, along_tokens: bool, pair_block: int):
        # m in [-24, 24]; one +-24 per block of 16 (along D for Q/K, along tokens for V).
        m = torch.randint(-23, 24, (half, heads, d), generator=gen)
        sign = torch.where(torch.rand(half, heads, d // fmt.BLOCK if not along_tokens else d,
                                      generator=gen) < 0.5, -24, 24)
        if along_tokens:
            pos = torch.randint(0, fmt.BLOCK, (half // fmt.BLOCK, heads, d), generator=gen)
            rows = torch.arange(half // fmt.BLOCK)[:, None, None] * fmt.BLOCK + pos
            m.scatter_(0, rows, sign[: half // fmt.BLOCK])
        else:
            pos = torch.randint(0, fmt.BLOCK, (half, heads, d // fmt.BLOCK), generator=gen)
            cols = torch.arange(d // fmt.BLOCK) * fmt.BLOCK + pos
            m.scatter_(2, cols, sign)
        # Tokens in +- pairs inside each block of pair_block rows: every mean is exactly 0.
        m = m.view(-1, pair_block // 2, heads, d)
        m = torch.cat([m, -m], 1).view(s, heads, d)
        x = m.double() * torch.exp2(channel_exp.double() - 2)
        return x.to(torch.bfloat16)[None].to(device)

    q = tensor(h, False, fmt.SEQ_TILE)
    k = tensor(hkv, False, s)
    v = tensor(hkv, True, s)
    return q, k, v


QUANTISED_FIELDS = ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf", "q_scale", "k_scale", "v_scale",
                    "q_mean", "k_mean", "v_mean", "balance")


def check_quantiser(q, k, v, qk_format: str = "nvfp4") -> tuple[bool, str]:
    """The CUDA quantiser's bytes against preprocess.quantize_qkv, exactly."""
    from .cuda import quantize

    got = quantize.quantize_qkv(q, k, v, layout="NHD", balance_qk=True, qk_format=qk_format)
    want = preprocess.quantize_qkv(q, k, v, layout="NHD", balance_qk=True, qk_format=qk_format)
    differ = []
    for name in QUANTISED_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if a.shape != b.shape:
            differ.append(f"{name} shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        n = int((a != b).sum())
        if n:
            differ.append(f"{name} differs in {n} of {a.numel()} elements")
    return not differ, ("bytes equal (e2m1 ties and subnormal scales included)" if not differ else "; ".join(differ))


def check_attention(q, k, v, qk_format: str = "nvfp4") -> tuple[bool, str]:
    """The kernel against the reference numerics."""
    from .cuda import attention as attention_cuda
    from .reference import attention_reference

    out, lse = attention_cuda.attention(q, k, v, layout="NHD", causal=False, scale=None, kv_lens=None,
                                           return_lse=True, balance_qk=True, qk_format=qk_format)
    ref, ref_lse = attention_reference(q, k, v, layout="NHD", return_lse=True, qk_format=qk_format)
    a, b = out.double().flatten(), ref.double().flatten()
    cos = (a @ b / (a.norm() * b.norm()).clamp_min(1e-300)).item()
    lse_err = (lse - ref_lse).abs().max().item()
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    ok = finite and cos >= ATTENTION_MIN_COS and lse_err <= ATTENTION_MAX_LSE_ERROR
    detail = f"cos {cos:.6f} (>= {ATTENTION_MIN_COS}), LSE error {lse_err:.2e} (<= {ATTENTION_MAX_LSE_ERROR})"
    return ok, detail if finite else detail + ", non-finite output"


if __name__ == "__main__":   # python -m nvfp4_dit.selftest: the report (nvfp4_dit.diagnostics)
    from .diagnostics import main

    sys.exit(main())
