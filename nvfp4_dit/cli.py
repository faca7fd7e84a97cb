"""The command-line arguments the video tools share (``scripts/generate_video.py``,
``capture_attention.py``): the model and sampling arguments and the NVFP4 policy's. Torch-free, like
:mod:`nvfp4_dit.defaults`, so that ``--help`` and a usage error answer without importing torch or
diffusers; :mod:`nvfp4_dit.processors.generation` turns the parsed arguments into a pipeline and a
policy.
"""

from __future__ import annotations

import argparse
import re

from .defaults import (BACKENDS, BALANCE_QK_DEFAULT, DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ_LEN,
                       DEFAULT_SPARSE_MIN_SEQ_LEN, DEFAULT_SPARSE_OFF_STEPS, QK_FORMAT_DEFAULT, QK_FORMATS)

DTYPE_NAMES = ("bf16", "fp16", "fp32")
"""--dtype's choices besides auto (processors.generation maps them to torch dtypes)."""

# The built-in tiny model's video sequence is 320 tokens: below the policy's default thresholds
# (min_seq_len, sparse_min_seq_len), which are sized for real models. Its runs use this one for
# both, so that its FP4 path runs and --keep-mass runs it block-sparse.
TINY_MIN_SEQ_LEN = 256

POLICY_GROUP = "NVFP4 attention policy"
"""The title of the policy arguments' group (``--policy FILE`` replaces them)."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error messages
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def parse_pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST,LAST (two ints), got {text!r}") from None
    if a < 0 or b < 0:
        raise argparse.ArgumentTypeError(f"steps must be >= 0, got {text!r}")
    return a, b


def keep_mass_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


keep_mass_arg.__name__ = "float"   # argparse names the type in its error messages

PAIR_OPTIONS = ("--dense-steps", "--sparse-off-steps")


def join_pair_values(argv: list) -> list:
    """``--dense-steps -1,1`` as ``--dense-steps=-1,1``: argparse reads a value that starts with "-"
    and is no plain number as an option, and would say "expected one argument" instead of what is
    wrong with the value."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PAIR_OPTIONS and i + 1 < len(argv) and re.fullmatch(r"-?\d+,-?\d+", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model and sampling")
    g.add_argument("--model", default=None,
                   help="diffusers pipeline: hub id or local folder (Wan 2.1/2.2, Cosmos Predict2/2.5, HunyuanVideo, "
                        "LTX-Video, CogVideoX, Mochi). Default: the built-in tiny random video DiT (CPU, seconds)")
    g.add_argument("--tiny-config", default=None, help="config JSON of the tiny model (default: the shipped one)")
    g.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--image", default=None, help="conditioning image (path or URL) for image-to-video pipelines")
    g.add_argument("--height", type=positive_int, default=None, help="default: the pipeline's (tiny: 128)")
    g.add_argument("--width", type=positive_int, default=None)
    g.add_argument("--frames", type=positive_int, default=None, help="number of frames (tiny: 17)")
    g.add_argument("--steps", type=positive_int, default=None, help="denoising steps (tiny: 8)")
    g.add_argument("--guidance-scale", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    g.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    g.add_argument("--cpu-offload", choices=("none", "model", "sequential"), default="none",
                   help="enable_model_cpu_offload / enable_sequential_cpu_offload (CUDA only)")
    a = ap.add_argument_group(POLICY_GROUP)
    a.add_argument("--backend", choices=BACKENDS, default=None,
                   help="nvfp4_dit.attention back-end for FP4 calls. Default: auto on CUDA (the kernel where the "
                        "native FP4 MMA exists), reference (FP4 numerics in PyTorch) on CPU")
    first, last = DEFAULT_DENSE_STEPS
    a.add_argument("--dense-steps", type=parse_pair, default=(first, last), metavar="FIRST,LAST",
                   help=f"first/last denoising steps that run dense attention (default {first},{last})")
    a.add_argument("--cross-attention", action="store_true", help="FP4 for cross-attention too (default: dense)")
    a.add_argument("--min-seq-len", type=non_negative_int, default=None,
                   help=f"calls with fewer query or key tokens stay dense (default {DEFAULT_MIN_SEQ_LEN}; the "
                        f"built-in tiny model, whose sequences are 320 tokens: {TINY_MIN_SEQ_LEN})")
    a.add_argument("--layers", default=None, help="comma-separated allow-list of module patterns, e.g. 'blocks.*.attn1'")
    a.add_argument("--balance-qk", action=argparse.BooleanOptionalAction, default=BALANCE_QK_DEFAULT,
                   help="balance Q and K per channel before FP4 quantisation (default: on)")
    a.add_argument("--qk-format", choices=QK_FORMATS, default=QK_FORMAT_DEFAULT,
                   help="Q·Kᵀ format: nvfp4 (default) or mxfp8 (8-bit Q·Kᵀ for sharp attention; P·V stays NVFP4)")
    a.add_argument("--keep-mass", type=keep_mass_arg, default=None, metavar="MASS",
                   help="block-sparse NVFP4: each call keeps, per 128-query block, the key tiles holding this "
                        "share of the estimated attention mass, e.g. 0.9 (default: dense)")
    a.add_argument("--sparse-off-steps", type=parse_pair, default=DEFAULT_SPARSE_OFF_STEPS, metavar="FIRST,LAST",
                   help="first/last denoising steps that stay dense NVFP4 with --keep-mass "
                        f"(default {DEFAULT_SPARSE_OFF_STEPS[0]},{DEFAULT_SPARSE_OFF_STEPS[1]})")
    a.add_argument("--sparse-min-seq-len", type=non_negative_int, default=None,
                   help=f"calls with fewer query or key tokens stay dense NVFP4 with --keep-mass "
                        f"(default {DEFAULT_SPARSE_MIN_SEQ_LEN}; the built-in tiny model: {TINY_MIN_SEQ_LEN})")
    a.add_argument("--policy", default=None, metavar="FILE",
                   help="a saved policy JSON (e.g. from --calibrate) instead of the policy arguments above")


