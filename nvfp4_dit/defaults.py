"""The defaults a call, a policy and the command-line tools share, in one torch-free module (so that
a tool's ``--help`` and usage errors need neither torch nor diffusers). The modules that use them
(:mod:`nvfp4_dit.format`, :mod:`nvfp4_dit.checks`, :mod:`nvfp4_dit.policy`,
:mod:`nvfp4_dit.calibration`) re-export them under the same names."""

BACKENDS = ("auto", "reference", "sdpa", "cuda")
"""The op's back-ends: ``auto`` (the kernel where it runs natively and passed its self-test, else
exact SDPA), ``reference`` (PyTorch), ``sdpa`` (exact), ``cuda`` (the kernel, emulated MMA on
sm_80 / sm_90)."""

QK_FORMATS = ("nvfp4", "mxfp8")
"""Formats of the quantised Q and K (P and V are NVFP4 in both): ``nvfp4``, or ``mxfp8``, e4m3 data
with one ue8m0 (power-of-two) scale per 32 elements along D (:mod:`nvfp4_dit.format`)."""
QK_FORMAT_DEFAULT = "nvfp4"

BALANCE_QK_DEFAULT = True
"""Whether Q and K are balanced per channel unless the caller says otherwise (docs/report)."""

DEFAULT_DENSE_STEPS = (1, 1)
"""First and last denoising steps that run exact attention."""
DEFAULT_MIN_SEQ_LEN = 1024
"""Calls with fewer query or key tokens run exact attention: FP4 gains nothing there."""
DEFAULT_SPARSE_OFF_STEPS = (2, 0)
"""First and last denoising steps that run dense NVFP4 under a block-sparse policy."""
DEFAULT_SPARSE_MIN_SEQ_LEN = 16384
"""Calls with fewer query or key tokens run dense NVFP4 under a block-sparse policy."""

# The calibration's error budget: relative L2 error of a layer's attention output. The op's errors
# with the FP4 path against exact attention on bf16 inputs (docs/report): iid 0.19, RoPE'd Q/K
# 0.10, the tiny Wan's self-attention 0.07, K outlier channels with the channel balance 0.22-0.27,
# logits twice as sharp as iid 0.33, three times 0.43.  0.25 keeps the first group in FP4 and
# sends the sharp heads to exact attention.
DEFAULT_BUDGET = 0.25
