#!/usr/bin/env python3
"""A static cost model of the native attention kernel on sm_120 (no GPU needed).

Compiles each native kernel for sm_120a with line info, reads its SASS (nvdisasm), finds the
key-tile loop (the innermost backward branch around one tile's MMAs), counts the instructions of
one steady-state tile per pipe, and models the clocks one SM spends per 128x128 tile:

* steady (non-causal, long rows): the loop body without its cold regions: the key mask (only on
  the last or diagonal tile), the O rescale (only when a row's max grows) and the slow path of
  the IEEE divide (a CALL);
* causal (a diagonal tile): the body with the mask and the rescale, still without the slow path.

Assumptions (sm_120, per SM sub-partition (SMSP) unless said; 8 warps per CTA, 1 CTA per SM, so
2 warps per SMSP):
  * 1 instruction issued per clock;
  * one m16n8k64 block-scaled FP4 MMA = 16 clocks of the tensor pipe (an m16n8k32 8-bit one: 16
    clocks for half the work; an fp16 m16n8k16 HMMA: 16);
  * MUFU (and conversions to/from integers): 16 lanes per clock per SM, 8 clocks per warp instruction;
  * fp32 FMA/FMUL/FADD and fp16x2 at full rate (1 clock per warp instruction); FMNMX, integer,
    logic, select, compare, moves and packs at half rate (2 clocks); both share the same cores,
    so their sum is one pipe; uniform-datapath and control instructions take only an issue slot;
  * shared memory: 128 B per clock per SM: an LDSM.x4 of a warp is 4 wavefronts, an LDS or a
    SHFL 1 (the kernel's LDS read scale words, key projections and corrections), and the cp.async
    fill of the next stage its bytes / 128, in the Q·Kᵀ phase;
  * every warp synchronises once per tile and runs Q·Kᵀ then softmax in lock-step, so the tile
    is two phases (up to the last Q·Kᵀ MMA, and the rest); each phase takes its slowest pipe and
    the tile the sum of both phases (``clocks_per_tile``). ``overlapped_clocks`` is the bound if
    phases of different warps overlapped perfectly (the slowest pipe over the whole tile).
  * boost clocks from NVIDIA's spec sheets: RTX 5090 2.407 GHz, 170 SMs; RTX PRO 6000 Blackwell
    2.617 GHz, 188 SMs. FP4 peak = SMs x 4 SMSPs x 16x8x64x2 FLOP / 16 clocks x clock.

Block-sparse attention (a block map; the ``_sparse`` kernels) at density d visits d of a row's key
tiles: modelled as ``d * nk * sparse_clocks_per_tile + LIST_LATENCY_CLOCKS`` per 128-row Q block
against ``nk * clocks_per_tile`` dense (nk = S / 128 key tiles; ``time_vs_dense`` in the JSON
rows, with ``density`` and ``seq``), where the sparse tile is the ``_sparse`` kernel's steady tile
(it reads its tile index from the list) and ``LIST_LATENCY_CLOCKS`` is the row's start: three
dependent global reads (visiting order, list offsets, the first tile index) at about 800 clocks
each before its first stage load issues, not hidden by other work of the CTA.

The preparation (the quantiser) is modelled separately from its bytes at the board's memory
bandwidth (1.792 TB/s, GDDR7 on both boards); B=1, H=40, D=128 bf16 NHD inputs, balance_qk on.
Quantisation reads Q twice (its block means for the smoothing basis, then its tiles), K and V once
each, plus the statistics tiles (16 per head of each); writes codes, scales, means, q . km, the
block statistics (key tile means, Q block similarity), the smoothing basis, each block's
coefficients and smoothed mean (read back by the Q tiles) and the key projections (16 fp16 values
per key and query head, a factor per 128 keys); and its fix-up pass reads and rewrites the K and V
scale bytes (every tile moved to its head's scale; the rare tile that is quantised again is left
out). The attention kernel forms the smoothing correction from the key projections (its SASS, above,
holds that work). The share is against the modelled attention time at the nvfp4 D=128 non-causal
TFLOP/s above. A block-sparse call at density d (``--json`` rows with ``seq_len``, ``density``,
``prep_share``) adds the estimate (the pooled scores written and read back, the map's bit words
and word counts, the int32 list of its d * nq * nk entries written); its attention time is the
dense time x ``time_vs_dense`` of the block-sparse kernel.

    python scripts/model_sm120.py            # table
    python scripts/model_sm120.py --json     # rows as JSON
    python scripts/model_sm120.py --check    # fail if a modelled tile is > 2 % slower than the baseline

The baseline (``scripts/model_sm120_baseline.json``) is updated deliberately when the kernel improves
(``--write-baseline``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_sass  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402

ASSUMPTIONS = "Assumptions" + __doc__.split("Assumptions", 1)[1].split("\n\n    python")[0]
BASELINE = Path(__file__).resolve().parent / "model_sm120_baseline.json"
TOLERANCE = 1.02
GPUS = {"RTX 5090": (170, 2.407e9), "RTX PRO 6000": (188, 2.617e9)}
MEMORY_BANDWIDTH = 1.792e12   # bytes/s, both boards
PREPARATION_SEQS = (32_768, 77_000, 118_800)
PREPARATION_DENSITIES = (1.0, 0.25)
SPARSE_DENSITIES = (0.5, 0.25, 0.1)
SPARSE_SEQS = (77_000, 118_800)
LIST_LATENCY_CLOCKS = 3 * 800
WARPS_PER_SMSP = 2
WARPS_PER_SM = 8
BLOCK = 128

TENSOR_CLOCKS = {"OMMA": 16, "QMMA": 16, "HMMA": 16}
MUFU_CLOCKS = 8
FULL_RATE = {"FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2", "HFMA2", "HMUL2", "HADD2", "FSWZADD"}
HALF_RATE = {"FMNMX", "IMAD", "IADD3", "IADD", "LOP3", "SHF", "SEL", "FSEL", "ISETP", "FSETP", "LEA", "IMNMX",
             "PRMT", "IABS", "VIADD", "VIMNMX", "MOV", "MOV32I", "F2FP", "FCHK", "VOTE", "P2R", "R2P", "CS2R",
             "S2R", "POPC", "FLO", "BMSK", "SGXT", "PLOP3", "HSETP2", "HMNMX2", "I2FP", "F2IP"}
CONVERSIONS = {"I2F", "F2I", "F2F", "FRND"}
SMEM = {"LDS", "STS", "LDSM", "LDGSTS", "ATOMS", "SHFL", "LDSTS"}


def pipe_of(opcode: str) -> str:
    """"tensor", "mufu", "fma", "alu", "smem" or "issue" (an issue slot only) for a SASS opcode."""
    base = opcode.split(".")[0]
    if base in TENSOR_CLOCKS:
        return "tensor"
    if base == "MUFU" or base in CONVERSIONS:
        return "mufu"
    if base in FULL_RATE:
        return "fma"
    if base in HALF_RATE:
        return "alu"
    if base in SMEM:
        return "smem"
    return "issue"


def smem_wavefronts(opcode: str) -> int:
    """128-byte shared-memory wavefronts of one warp instruction (cp.async: counted per stage)."""
    base = opcode.split(".")[0]
    if base == "LDGSTS":
        return 0
    if base == "LDSM":
        m = re.search(r"\.M88\.(\d)", opcode)
        return int(m.group(1)) if m else 1
    return 1


@dataclass
class Instruction:
    addr: int
    opcode: str
    operands: str
    predicated: bool
    file: str = ""
    line: int = 0


@dataclass
class Function:
    name: str
    code: list = field(default_factory=list)
    labels: dict = field(default_factory=dict)  # label -> address of the next instruction


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNC = re.compile(r"^\.text\.(\S+):")


def parse_nvdisasm(text: str) -> dict[str, Function]:
    """Functions of ``nvdisasm --print-line-info`` output: instructions with their source line."""
    funcs: dict[str, Function] = {}
    cur, file, line, pending = None, "", 0, []
    for raw in text.splitlines():
        s = raw.strip()
        m = _FUNC.match(s)
        if m:
            cur = funcs.setdefault(m.group(1), Function(m.group(1)))
            pending = []
            continue
        if cur is None:
            continue
        m = _LINE.search(s)
        if m:
            file, line = Path(m.group(1)).name, int(m.group(2))
            continue
        m = _LABEL.match(s)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.search(s)
        if m:
            addr = int(m.group(1), 16)
            for label in pending:
                cur.labels[label] = addr
            pending = []
            cur.code.append(Instruction(addr, m.group(3), m.group(4).strip(), m.group(2) is not None, file, line))
    return funcs


def _target(fn: Function, insn: Instruction):
    m = re.search(r"`\((\.L_x_\d+)\)", insn.operands)
    return fn.labels.get(m.group(1)) if m else None


def tile_loop(fn: Function, mma_per_tile: int) -> tuple[int, int]:
    """(first, last) instruction indices of the innermost backward-branch loop holding one tile's MMAs."""
    index = {insn.addr: i for i, insn in enumerate(fn.code)}
    best = None
    for i, insn in enumerate(fn.code):
        if not insn.opcode.startswith("BRA"):
            continue
        target = _target(fn, insn)
        if target is None or target > insn.addr or target not in index:
            continue
        first = index[target]
        mma = sum(pipe_of(x.opcode) == "tensor" for x in fn.code[first:i + 1])
        if mma == mma_per_tile and (best is None or i - first < best[1] - best[0]):
            best = (first, i)
    if best is None:
        raise RuntimeError(f"{fn.name}: no loop with {mma_per_tile} MMAs per tile")
    return best


def cold_regions(fn: Function, first: int, last: int, rescale_lines: set[int]) -> dict[str, set[int]]:
    """Instruction indices inside the loop that a steady-state tile skips, by kind: the regions a
    forward conditional branch jumps over that hold the mask (mask.cuh), the O rescale, or a CALL."""
    index = {insn.addr: i for i, insn in enumerate(fn.code)}
    kinds: dict[str, set[int]] = {"mask": set(), "rescale": set(), "slow path": set()}
    for i in range(first, last + 1):
        insn = fn.code[i]
        if not insn.opcode.startswith("BRA") or not insn.predicated and ".U" not in insn.opcode:
            continue
        target = _target(fn, insn)
        if target is None or target <= insn.addr or index.get(target, last + 1) > last + 1:
            continue
        region = range(i + 1, index[target])
        body = [fn.code[j] for j in region]
        if any(x.opcode.startswith("CALL") for x in body):
            kinds["slow path"].update(region)
        elif any(x.file == "mask.cuh" for x in body):
            kinds["mask"].update(region)
        elif any(x.file == "kernel.cuh" and x.line in rescale_lines for x in body):
            kinds["rescale"].update(region)
    return kinds


def count(insns) -> dict:
    c = {"instructions": 0, "tensor": 0, "mufu": 0, "fma": 0, "alu": 0, "smem_wavefronts": 0, "tensor_clocks": 0}
    for insn in insns:
        if insn.opcode == "NOP":
            continue
        c["instructions"] += 1
        pipe = pipe_of(insn.opcode)
        if pipe == "tensor":
            c["tensor"] += 1
            c["tensor_clocks"] += TENSOR_CLOCKS[insn.opcode.split(".")[0]]
        elif pipe == "smem":
            c["smem_wavefronts"] += smem_wavefronts(insn.opcode)
        elif pipe in c:
            c[pipe] += 1
    return c


def phase_clocks(c: dict, stage_wavefronts: int = 0) -> dict:
    """Clocks of one phase per pipe for one SMSP (2 warps), shared memory for the whole SM."""
    return {
        "issue": WARPS_PER_SMSP * c["instructions"],
        "tensor": WARPS_PER_SMSP * c["tensor_clocks"],
        "mufu": WARPS_PER_SMSP * MUFU_CLOCKS * c["mufu"],
        "fma+alu": WARPS_PER_SMSP * (c["fma"] + 2 * c["alu"]),
        "smem": WARPS_PER_SM * c["smem_wavefronts"] + stage_wavefronts,
    }


def mma_counts(head_dim: int, qk_format: str) -> tuple[int, int]:
    """(Q·Kᵀ, P·V) MMAs per warp and 128-key tile: m16n8k64 FP4, or m16n8k32 8-bit for MXFP8 Q·Kᵀ."""
    qk, pv = check_sass.mma_per_warp_tile(head_dim)
    return (2 * qk if qk_format == "mxfp8" else qk), pv


def model_kernel(fn: Function, head_dim: int, causal: bool, rescale_lines: set[int], stage_bytes: int,
                 mma_per_tile: tuple[int, int] | None = None, qk_format: str = "nvfp4") -> dict:
    """The row of one kernel; ``mma_per_tile`` = (Q·Kᵀ, P·V) MMAs per warp and tile (default: the
    kernel's layout for ``head_dim`` and ``qk_format``)."""
    qk, pv = mma_per_tile or mma_counts(head_dim, qk_format)
    first, last = tile_loop(fn, qk + pv)
    cold = cold_regions(fn, first, last, rescale_lines)
    skip = cold["slow path"] | (set() if causal else cold["mask"] | cold["rescale"])
    body = [(i, fn.code[i]) for i in range(first, last + 1) if i not in skip]
    # Phase A ends with the last Q·Kᵀ MMA (the first qk MMAs of the body).
    seen, split = 0, len(body)
    for n, (_, insn) in enumerate(body):
        if pipe_of(insn.opcode) == "tensor":
            seen += 1
            if seen == qk:
                split = n + 1
                break
    phases = [count(x for _, x in body[:split]), count(x for _, x in body[split:])]
    stage = stage_bytes // 128
    clocks = [phase_clocks(phases[0], stage), phase_clocks(phases[1])]
    total = count(x for _, x in body)
    whole = phase_clocks(total, stage)
    clocks_per_tile = sum(max(c.values()) for c in clocks)
    flops = 2 * 2 * BLOCK * BLOCK * head_dim   # Q·Kᵀ and P·V of one 128x128 tile (either format)
    row = {
        "head_dim": head_dim, "causal": causal, "qk_format": qk_format,
        **{k: total[k] for k in ("instructions", "tensor", "mufu", "fma", "alu", "smem_wavefronts")},
        "stage_bytes": stage_bytes,
        "cold_skipped": {k: len(v) for k, v in cold.items() if v and (k == "slow path" or not causal)},
        "phase_bounds": [max(c, key=c.get) for c in clocks],
        "phase_clocks": clocks,
        "clocks_per_tile": clocks_per_tile,
        "tensor_clocks_per_tile": whole["tensor"],
        "overlapped_clocks": max(whole.values()),
        "tensor_share": round(whole["tensor"] / clocks_per_tile, 4),
    }
    for gpu, (sms, clock) in GPUS.items():
        row[f"tflops {gpu}"] = round(sms * flops * clock / clocks_per_tile / 1e12, 1)
    return row


def rescale_source_lines(kernel_source: str) -> set[int]:
    """Lines of kernel.cuh that scale the O accumulator by alpha (the conditional rescale)."""
    return {n for n, text in enumerate(kernel_source.splitlines(), 1) if re.search(r"o\[j\]\[\d\] \*= alpha", text)}


def disassemble_with_lines(cubin: Path) -> str:
    nvdisasm = check_sass.find_tool("nvdisasm")
    if nvdisasm is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    res = subprocess.run([nvdisasm, "--print-line-info", "-c", str(cubin)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvdisasm failed: {res.stderr}")
    return res.stdout


def compile_with_lines(unit: str, arch: str, out: Path) -> Path:
    nvcc = check_sass.find_tool("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    cubin = out / f"{Path(unit).stem}_sm{arch}_lines.cubin"
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", "-lineinfo", f"-I{check_sass.CSRC}",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", str(check_sass.CSRC / unit), "-o", str(cubin)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed for {unit}:\n{res.stderr}")
    return cubin


def model(arch: str = "120a") -> list[dict]:
    """One row per (GPU-independent) head dim and causal setting, with TFLOP/s per GPU."""
    rescale = rescale_source_lines((check_sass.CSRC / "attention" / "kernel.cuh").read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qk_format in fmt.QK_FORMATS:
            units = check_sass.UNITS if qk_format == "nvfp4" else check_sass.MX_UNITS
            for d in fmt.SUPPORTED_HEAD_DIMS:
                stage_bytes = check_sass.dynamic_smem_bytes(d, Path(tmp), "kStageBytes", qk_format)
                funcs = parse_nvdisasm(disassemble_with_lines(compile_with_lines(units[d], arch, Path(tmp))))
                names = [n for n in funcs if n.startswith(check_sass.ATTENTION_PREFIX)]
                dense = next(n for n in names if "_sparse" not in n)
                block_sparse = next(n for n in names if n.endswith("_sparse"))
                for causal in (False, True):
                    row = model_kernel(funcs[dense], d, causal, rescale, stage_bytes, qk_format=qk_format)
                    sparse_row = model_kernel(funcs[block_sparse], d, causal, rescale, stage_bytes, qk_format=qk_format)
                    row["sparse_clocks_per_tile"] = sparse_row["clocks_per_tile"]
                    rows.append(row)
    return rows


def time_vs_dense(row: dict, density: float, seq: int) -> float:
    """Modelled time of the block-sparse kernel at ``density`` over the dense kernel's, one Q block
    of a ``seq``-key row (module docstring)."""
    nk = -(-seq // BLOCK)
    sparse = density * nk * row["sparse_clocks_per_tile"] + LIST_LATENCY_CLOCKS
    return sparse / (nk * row["clocks_per_tile"])


def preparation(seq: int, attention_tflops: float, heads: int = 40, head_dim: int = 128, density: float = 1.0,
                attention_vs_dense: float = 1.0) -> dict:
    """Modelled time of the quantiser (+ the estimate of a block-sparse call at ``density`` < 1) at
    B=1 (module docstring) and its share of attention (dense time x ``attention_vs_dense``)."""
    from nvfp4_dit import smoothing

    elems = seq * heads * head_dim
    skp = -(-seq // fmt.SEQ_TILE) * fmt.SEQ_TILE
    nblk = skp // fmt.SEQ_TILE
    block_stats = nblk * heads * head_dim * 4 + nblk * heads * 4           # key tile means, Q similarity
    sampled = min(seq, fmt.STATISTICS_TILES * fmt.SEQ_TILE) * heads * head_dim * 2   # one tensor's statistics tiles
    rank, columns = smoothing.Q_BASIS_RANK, smoothing.KEY_PROJECTION_COLUMNS
    smoothing_bytes = (2 * elems                                  # Q read once more, for its block means
                       + 2 * nblk * heads * head_dim * 4          # the block means, written and read by the basis
                       + nblk * heads * (rank + 2 * head_dim) * 4  # coefficients; smoothed means written and read
                       + skp * heads * (2 * columns + 4 / fmt.SEQ_TILE))   # key projections and factors
    quant_bytes = (3 * 2 * elems + 3 * sampled + 3 * elems // 2 + 3 * elems // 16 + 2 * 2 * elems // 16
                   + (seq // 128 + 1) * heads * head_dim * 4 + seq * heads * 4 + block_stats + smoothing_bytes)
    map_elems = nblk * nblk * heads
    words = -(-nblk // 32)
    estimate_bytes = 0.0 if density >= 1.0 else (
        2 * map_elems * 4                       # pooled scores: the matmul writes them, the map kernel reads
        + 3 * nblk * heads * words * 4 * 2      # bit words and word counts, written and read by the lists
        + density * map_elems * 4)              # the listed tiles
    t_quant = quant_bytes / MEMORY_BANDWIDTH
    t_estimate = estimate_bytes / MEMORY_BANDWIDTH
    t_attention = 4 * seq * seq * head_dim * heads / (attention_tflops * 1e12) * attention_vs_dense
    return dict(seq=seq, density=density, quantize_ms=t_quant * 1e3, quantize_gb=quant_bytes / 1e9,
                estimate_ms=t_estimate * 1e3, attention_ms=t_attention * 1e3,
                share=(t_quant + t_estimate) / t_attention)


def preparation_rows(rows: list[dict]) -> list[dict]:
    """Per GPU, length and density (PREPARATION_DENSITIES) the modelled preparation, B1 H40 D128."""
    base = next(r for r in rows if r["qk_format"] == "nvfp4" and r["head_dim"] == 128 and not r["causal"])
    return [{"gpu": gpu, **preparation(s, base[f"tflops {gpu}"], density=d,
                                       attention_vs_dense=time_vs_dense(base, d, s) if d < 1 else 1.0)}
            for gpu in GPUS for s in PREPARATION_SEQS for d in PREPARATION_DENSITIES]


def gpu_rows(rows: list[dict]) -> list[dict]:
    """The rows once per GPU, as the JSON output lists them: each kernel dense (``density`` 1,
    ``seq`` None) and block-sparse at SPARSE_DENSITIES x SPARSE_SEQS, with ``time_vs_dense``."""
    out = []
    for r in rows:
        for gpu, (sms, clock) in GPUS.items():
            base = {k: v for k, v in r.items() if not k.startswith("tflops ")}
            row = {"gpu": gpu, "sms": sms, "boost_ghz": clock / 1e9, **base, "tflops": r[f"tflops {gpu}"]}
            out.append({**row, "density": 1.0, "seq": None, "time_vs_dense": 1.0})
            out += [{**row, "density": d, "seq": s, "time_vs_dense": round(time_vs_dense(r, d, s), 4)}
                    for d in SPARSE_DENSITIES for s in SPARSE_SEQS]
    return out


def check_baseline(rows: list[dict], baseline: list[dict]) -> list[str]:
    want = {(b["head_dim"], b["causal"], b["qk_format"]): b["clocks_per_tile"] for b in baseline}
    failures = []
    for r in rows:
        key = (r["head_dim"], r["causal"], r["qk_format"])
        if key not in want:
            failures.append(f"no baseline for D={key[0]} causal={key[1]} {key[2]}")
        elif r["clocks_per_tile"] > want[key] * TOLERANCE:
            failures.append(f"D={key[0]} causal={key[1]} {key[2]}: {r['clocks_per_tile']} clocks per tile, "
                            f"more than 2 % over the baseline {want[key]}")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the rows (one per GPU) as a JSON list")
    ap.add_argument("--check", action="store_true", help=f"exit 1 if a tile models > 2 % slower than {BASELINE.name}")
    ap.add_argument("--write-baseline", action="store_true", help=f"record these figures in {BASELINE.name}")
    args = ap.parse_args(argv)
    rows = model()
    if args.json:
        prep = [{"gpu": r["gpu"], "seq_len": r["seq"], "density": r["density"], "prep_share": round(r["share"], 4),
                 **{k: round(r[k], 3) for k in ("quantize_ms", "estimate_ms", "attention_ms")}}
                for r in preparation_rows(rows)]
        print(json.dumps(gpu_rows(rows) + prep, indent=1))
    else:
        print(ASSUMPTIONS)
        cols = ["qk_format", "head_dim", "causal", "instructions", "tensor", "mufu", "fma", "alu", "smem_wavefronts",
                "phase_bounds", "tensor_clocks_per_tile", "clocks_per_tile", "overlapped_clocks", "tensor_share",
                *[f"tflops {g}" for g in GPUS]]
        print("\nPer warp and steady-state 128-key tile (clocks per SM):\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r[c]) if not isinstance(r[c], list) else "/".join(r[c]) for c in cols) + " |")
        print("\nBlock-sparse: modelled time at density d over dense (the same kernel and shape):\n")
        print("| Q·Kᵀ | D | causal | sparse clocks per tile | " + " | ".join(
            f"d={d} S={s:,}" for d in SPARSE_DENSITIES for s in SPARSE_SEQS) + " |")
        print("|" + "---|" * (4 + len(SPARSE_DENSITIES) * len(SPARSE_SEQS)))
        for r in rows:
            print(f"| {r['qk_format']} | {r['head_dim']} | {r['causal']} | {r['sparse_clocks_per_tile']} | " + " | ".join(
                f"{time_vs_dense(r, d, s):.3f}" for d in SPARSE_DENSITIES for s in SPARSE_SEQS) + " |")
        print("\nPreparation (the quantiser + a sparse call's estimate), B=1 H=40 D=128, against the "
              "modelled attention at the same density:\n")
        print("| GPU | S | density | quantise ms (GB) | estimate ms | attention ms | preparation / attention |")
        print("|---|---|---|---|---|---|---|")
        for r in preparation_rows(rows):
            print(f"| {r['gpu']} | {r['seq']:,} | {r['density']} | {r['quantize_ms']:.2f} ({r['quantize_gb']:.2f}) "
                  f"| {r['estimate_ms']:.2f} | {r['attention_ms']:.1f} | {r['share']:.1%} |")
    if args.write_baseline:
        BASELINE.write_text(json.dumps([{k: r[k] for k in ("head_dim", "causal", "qk_format", "clocks_per_tile",
                                                             "sparse_clocks_per_tile")}
                                        for r in rows], indent=1) + "\n")
    if args.check:
        failures = check_baseline(rows, json.loads(BASELINE.read_text()))
        for f in failures:
            print("FAIL:", f, file=sys.stderr)
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
