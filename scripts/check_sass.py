#!/usr/bin/env python3
"""Check the native NVFP4 attention build without a GPU: compile for sm_120a / sm_121a, then read
the cubin's SASS and ptxas's report.

Checks, per kernel instantiation:
  * the block-scaled FP4 MMA ``OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X`` is there, as many times as
    the warp layout implies: each of the 8 warps owns 16 Q rows of a 128x128 tile and issues
    (128/8) * (D/64) QK^T MMAs plus (D/8) * (128/64) PV MMAs per key tile, i.e. 64 at D=128 and 32
    at D=64 (512 / 256 per CTA). The key-tile loop body is emitted once, and the PV of a tile runs
    one iteration late (overlapping the next tile's softmax), so the last tile's PV MMAs follow
    the loop once more: 64 + 32 = 96 in the SASS at D=128, 32 + 16 = 48 at D=64;
  * the scale selectors of every OMMA: thread-id-a 0 and thread-id-b 0..3, each thread-id-b on a
    quarter of the MMAs (the B fragments of each pair of n8 tiles use 2jj and 2jj + 1). In SASS
    the selectors are one uniform-register operand; its encoding is read off the single-MMA probe
    kernels (csrc/attention/mma_probe.cu), which instantiate every legal
    (thread-id-a, thread-id-b) pair, and each kernel's operand value off the UMOV that sets it;
  * the MXFP8 Q·Kᵀ kernels: ``QMMA.SF.16832.F32.E4M3.E4M3.E8`` (m16n8k32 kind::mxf8f6f4,
    ue8m0 scale_vec::1X) (128/8) * (D/32) times, all in the loop (64 at D=128, 32 at D=64), with
    thread-id-a 0, thread-id-b 0..3 and each byte-id 0..min(4, D/32)-1 on equal shares (encoding
    read off the 32 8-bit probe kernels), and the FP4 P·V as above (2 x 32 or 2 x 16 OMMA);
  * ptxas: 0 bytes of spill stores/loads and no stack frame; SASS: no local loads/stores;
  * the preparation kernels (the quantiser's, the smoothing basis, the block lists): 0 bytes of
    spills.
Prints markdown tables; exit status 1 if a check fails.

Needs nvcc, and cuobjdump + nvdisasm (PATH, PyPI ``nvidia-cuda-cuobjdump`` /
``nvidia-cuda-nvdisasm``, or the copies in torch's ``triton`` wheel).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nvfp4_dit.cuda import build
from nvfp4_dit import format as fmt

CSRC = build.csrc_dir()
OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"
QMMA = "QMMA.SF.16832.F32.E4M3.E4M3.E8"   # m16n8k32 kind::mxf8f6f4 e4m3, ue8m0 scale_vec::1X
PREPARATION_UNITS = ("quantize/quantize_tiles.cu", "quantize/smoothing_basis.cu", "quantize/block_lists.cu")
UNITS = {d: f"attention/attention_fwd_native_d{d}.cu" for d in fmt.SUPPORTED_HEAD_DIMS}
MX_UNITS = {d: f"attention/attention_fwd_native_mxfp8_d{d}.cu" for d in fmt.SUPPORTED_HEAD_DIMS}
ARCHS = tuple(a[3:] for a in build.NATIVE_ARCHS)  # "120a", "121a"
ATTENTION_PREFIX = "nvfp4_dit_attention_fwd_"   # the entry points (csrc/common/launch.h)


def mma_per_warp_tile(head_dim: int, block_n: int = 128) -> tuple[int, int]:
    """(QK^T, PV) m16n8k64 MMAs one warp issues per 128-key tile."""
    qk = (block_n // 8) * (head_dim // 64)   # n8 tiles of the score tile x k64 chunks of D
    pv = (head_dim // 8) * (block_n // 64)   # n8 tiles of the output x k64 chunks of the keys
    return qk, pv


def expected_mma_per_warp(head_dim: int) -> int:
    qk, pv = mma_per_warp_tile(head_dim)
    return qk + pv


def expected_mma_in_sass(head_dim: int) -> int:
    """Static count: the loop body (QK of tile n + PV of tile n-1) plus the drained last PV."""
    qk, pv = mma_per_warp_tile(head_dim)
    return qk + 2 * pv


def expected_mx_mma_in_sass(head_dim: int, block_n: int = 128) -> tuple[int, int]:
    """(8-bit QK m16n8k32 MMAs, FP4 PV MMAs) in the SASS of an MXFP8 Q·Kᵀ kernel."""
    _, pv = mma_per_warp_tile(head_dim, block_n)
    return (block_n // 8) * (head_dim // 32), 2 * pv


def expected_mma_of(kernel: str) -> dict[str, int] | None:
    """The MMA counts the SASS of native entry point ``kernel`` must hold: {omma, qmma} of an
    attention kernel; None for the other entry points."""
    m = re.fullmatch(r"nvfp4_dit_attention_fwd_native_(nvfp4|mxfp8)_d(\d+)(_sparse)?", kernel)
    if m:
        d = int(m.group(2))
        if m.group(1) == "nvfp4":
            return dict(omma=expected_mma_in_sass(d), qmma=0)
        qmma, omma = expected_mx_mma_in_sass(d)
        return dict(omma=omma, qmma=qmma)
    return None


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else from a PyPI wheel: nvidia-cuda-* (nvidia/*/bin) or triton, which
    torch installs on Linux and which ships cuobjdump and nvdisasm (triton/backends/nvidia/bin)."""
    found = shutil.which(name)
    if found:
        return found
    for base in sys.path:
        patterns = (os.path.join(base, "nvidia", "**", "bin", name),
                    os.path.join(base, "triton", "backends", "nvidia", "bin", name))
        for pattern in patterns:
            for cand in glob.glob(pattern, recursive=True):
                if os.access(cand, os.X_OK):
                    return cand
    return None


def compile_cubin(unit: str, arch: str, out_dir: Path) -> tuple[Path, str]:
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    out = out_dir / f"{Path(unit).stem}_sm{arch}.cubin"
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-I{CSRC}", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-Xptxas", "-v", str(CSRC / unit), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed for {unit} sm_{arch}:\n{res.stderr}")
    return out, res.stderr + res.stdout


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """{mangled kernel: {registers, spill_stores, spill_loads, stack}} from ``ptxas -v``."""
    info: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            info[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            info[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            info[current]["registers"] = int(m.group(1))
    return info


def disassemble(cubin: Path) -> str:
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise FileNotFoundError("cuobjdump/nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"cuobjdump failed: {res.stderr}")
    return res.stdout


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def sass_counts(sass: str) -> dict[str, dict]:
    """{mangled kernel: {omma, qmma, local, selectors, qmma_selectors}} from ``cuobjdump -sass``
    text. ``selectors`` lists the value of each OMMA's selector operand (a uniform register, URZ =
    0), ``qmma_selectors`` each QMMA's, found by following the writes to uniform registers in
    program order: a constant UMOV gives a value, any other write makes it unknown (None)."""
    counts: dict[str, dict] = {}
    current, uniform = None, {}
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current, uniform = m.group(1), {}
            counts[current] = {"omma": 0, "qmma": 0, "local": 0, "selectors": [], "qmma_selectors": []}
            continue
        m = _INSTRUCTION.search(line)
        if current is None or m is None:
            continue
        opcode, operands = m.group(1), [o.strip() for o in m.group(2).split(",")]
        if opcode in (OMMA, QMMA):
            key = "omma" if opcode == OMMA else "qmma"
            counts[current][key] += 1
            sel = operands[-1].split(".")[0]
            counts[current]["selectors" if key == "omma" else "qmma_selectors"].append(
                0 if sel == "URZ" else uniform.get(sel))
        elif operands and re.fullmatch(r"UR\d+", operands[0]):
            value = None
            if opcode == "UMOV" and len(operands) == 2:
                value = 0 if operands[1] == "URZ" else (int(operands[1], 16) if operands[1].startswith("0x") else None)
            uniform[operands[0]] = value
        if re.fullmatch(r"(LDL|STL)(\..*)?", opcode):
            counts[current]["local"] += 1
    return counts


PROBE_UNIT = "attention/mma_probe.cu"


def _probe_encoding(arch: str, out_dir: Path, probe: str, kind: str, count: int) -> dict[int, int]:
    """{selector operand value: combination I} of the native probe kernels nvfp4_dit_mma_probe_<probe>_native_<I>
    (csrc/attention/mma_probe.cu), which instantiate every legal combination."""
    cubin, _ = compile_cubin(PROBE_UNIT, arch, out_dir)
    encoding: dict[int, int] = {}
    for kernel, c in sass_counts(disassemble(cubin)).items():
        m = re.fullmatch(rf"nvfp4_dit_mma_probe_{probe}_native_(\d+)", kernel)
        if m is None:
            continue
        selectors = c["selectors" if kind == "omma" else "qmma_selectors"]
        if c[kind] != 1 or selectors[0] is None:
            raise RuntimeError(f"probe {kernel}: expected one {kind.upper()} with a constant selector, got {c}")
        encoding[selectors[0]] = int(m.group(1))
    if sorted(encoding.values()) != list(range(count)):
        raise RuntimeError(f"the {probe} kernels do not give all {count} selector combinations distinctly: {encoding}")
    return encoding


def selector_encoding(arch: str, out_dir: Path) -> dict[int, tuple[int, int]]:
    """{selector operand value: (thread-id-a, thread-id-b)} of the FP4 MMA."""
    return {v: (i // 4, i % 4) for v, i in _probe_encoding(arch, out_dir, "nvfp4", "omma", 8).items()}


def mx_selector_encoding(arch: str, out_dir: Path) -> dict[int, tuple[int, int, int]]:
    """{selector operand value: (thread-id-a, thread-id-b, byte-id)} of the 8-bit MMA."""
    return {v: (i // 16, (i // 4) % 4, i % 4)
            for v, i in _probe_encoding(arch, out_dir, "mxfp8", "qmma", 32).items()}


def selector_failures(name: str, selectors: list, encoding: dict, count: int, byte_ids: int = 0) -> list[str]:
    """thread-id-a 0 everywhere, thread-id-b 0..3 on a quarter of the MMAs each, and (8-bit MMA,
    ``byte_ids`` > 0) each byte-id 0..byte_ids-1 on an equal share of every thread-id-b."""
    decoded = [encoding.get(v) if v is not None else None for v in selectors]
    if None in decoded:
        unknown = sorted({hex(v) if v is not None else "not a constant" for v, d in zip(selectors, decoded) if d is None})
        return [f"{name}: MMA selector operands not decodable: {unknown}"]
    found = {key: decoded.count(key) for key in sorted(set(decoded))}
    if byte_ids:
        want = {(0, b, i): count // 4 // byte_ids for b in range(4) for i in range(byte_ids)}
        what = "(thread-id-a, thread-id-b, byte-id)"
    else:
        want = {(0, b): count // 4 for b in range(4)}
        what = "(thread-id-a, thread-id-b)"
    return [] if found == want else [f"{name}: scale selectors {what}: count {found}, expected {want}"]


def dynamic_smem_bytes(head_dim: int, out_dir: Path, member: str = "kSmemBytes", qk_format: str = "nvfp4") -> int:
    """AttentionTraits<D, QkFmt>::kSmemBytes (or another int member), read from the header by a
    host-only nvcc program."""
    qk = {"nvfp4": "nvfp4_dit::QkFormatNvfp4", "mxfp8": "nvfp4_dit::QkFormatMxfp8"}[qk_format]
    src = out_dir / f"{member}_{qk_format}_d{head_dim}.cu"
    src.write_text('#include <cstdio>\n#include "attention/traits.cuh"\n'
                   f'int main() {{ std::printf("%d", nvfp4_dit::AttentionTraits<{head_dim}, {qk}>::{member}); }}\n')
    exe = out_dir / f"{member}_{qk_format}_d{head_dim}"
    subprocess.run([find_tool("nvcc"), "-std=c++17", f"-I{CSRC}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    return int(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)


def _check_unit(arch: str, d: int, qk_format: str, tmp: Path, encoding: dict, mx_encoding: dict) -> tuple[list, list]:
    rows, failures = [], []
    smem = dynamic_smem_bytes(d, tmp, qk_format=qk_format)
    cubin, log = compile_cubin((UNITS if qk_format == "nvfp4" else MX_UNITS)[d], arch, tmp)
    ptx = parse_ptxas(log)
    sass = sass_counts(disassemble(cubin))
    if qk_format == "nvfp4":
        want_qmma, want_omma = 0, expected_mma_in_sass(d)
    else:
        want_qmma, want_omma = expected_mx_mma_in_sass(d)
    for kernel in sorted(k for k in sass if k.startswith(ATTENTION_PREFIX)):
        p, s = ptx.get(kernel, {}), sass[kernel]
        row = dict(arch=f"sm_{arch}", head_dim=d, qk_format=qk_format, sparse="_sparse" in kernel, omma=s["omma"],
                   expected=want_omma, qmma=s["qmma"], expected_qmma=want_qmma,
                   registers=p.get("registers"), spill=p.get("spill_stores", -1) + p.get("spill_loads", -1),
                   stack=p.get("stack"), local=s["local"], smem=smem,
                   selectors=", ".join(f"{s['selectors'].count(v)}x{encoding.get(v, '?')}"
                                       for v in sorted(set(s["selectors"]), key=str)),
                   qmma_selectors=", ".join(f"{s['qmma_selectors'].count(v)}x{mx_encoding.get(v, '?')}"
                                            for v in sorted(set(s["qmma_selectors"]), key=str)))
        rows.append(row)
        name = f"sm_{arch} D={d} {qk_format} sparse={row['sparse']}"
        failures += selector_failures(name, s["selectors"], encoding, want_omma)
        if want_qmma:
            failures += selector_failures(name + " 8-bit", s["qmma_selectors"], mx_encoding, want_qmma,
                                          byte_ids=min(4, d // 32))
        if s["omma"] != want_omma:
            failures.append(f"{name}: {s['omma']} {OMMA} in SASS, expected {want_omma}")
        if s["qmma"] != want_qmma:
            failures.append(f"{name}: {s['qmma']} {QMMA} in SASS, expected {want_qmma}")
        if row["spill"] != 0 or row["stack"] != 0 or s["local"] != 0:
            failures.append(f"{name}: spills {row['spill']} B, stack {row['stack']} B, "
                            f"{s['local']} local memory instructions")
        if smem > 99 * 1024:
            failures.append(f"{name}: {smem} B shared memory exceeds sm_120's 99 KB")
    if not any(k.startswith(ATTENTION_PREFIX) for k in sass):
        failures.append(f"sm_{arch} D={d} {qk_format}: no attention kernel in the cubin")
    return rows, failures


def check(archs=ARCHS, head_dims=fmt.SUPPORTED_HEAD_DIMS, qk_formats=fmt.QK_FORMATS) -> tuple[list[dict], list[str]]:
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for arch in archs:
            encoding = selector_encoding(arch, tmp)
            mx_encoding = mx_selector_encoding(arch, tmp) if "mxfp8" in qk_formats else {}
            for qk_format in qk_formats:
                for d in head_dims:
                    r, f = _check_unit(arch, d, qk_format, tmp, encoding, mx_encoding)
                    rows += r
                    failures += f
    return rows, failures


def check_preparation(archs=ARCHS) -> tuple[list[dict], list[str]]:
    """Spills of every preparation kernel."""
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            for unit in PREPARATION_UNITS:
                _, log = compile_cubin(unit, arch, Path(tmp))
                for kernel, p in sorted(parse_ptxas(log).items()):
                    row = dict(arch=f"sm_{arch}", kernel=kernel, registers=p.get("registers"),
                               spill=p.get("spill_stores", -1) + p.get("spill_loads", -1))
                    rows.append(row)
                    if row["spill"] != 0:
                        failures.append(f"sm_{arch} {kernel}: spills {row['spill']} B")
    return rows, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="e.g. 120a (default: 120a and 121a)")
    args = ap.parse_args()
    rows, failures = check(tuple(args.arch) if args.arch else ARCHS)
    print("| arch | D | Q·Kᵀ | block-sparse | OMMA in SASS (expected) | selectors: count x (tid-a, tid-b) "
          "| QMMA (expected) | QMMA selectors: count x (tid-a, tid-b, byte-id) "
          "| registers | spill B | stack B | local ops | dyn smem B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['head_dim']} | {r['qk_format']} | {r['sparse']} | {r['omma']} ({r['expected']}) | "
              f"{r['selectors']} | {r['qmma']} ({r['expected_qmma']}) | {r['qmma_selectors'] or '-'} | "
              f"{r['registers']} | {r['spill']} | {r['stack']} | {r['local']} | {r['smem']} |")
    prep_rows, prep_failures = check_preparation(tuple(args.arch) if args.arch else ARCHS)
    print("\n| arch | preparation kernel | registers | spill B |")
    print("|---|---|---|---|")
    for r in prep_rows:
        print(f"| {r['arch']} | {r['kernel']} | {r['registers']} | {r['spill']} |")
    for f in failures + prep_failures:
        print("FAIL:", f)
    return 1 if failures or prep_failures else 0


if __name__ == "__main__":
    sys.exit(main())
