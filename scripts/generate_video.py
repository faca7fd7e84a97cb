#!/usr/bin/env python3
"""Text/image-to-video with a diffusers pipeline and NVFP4 attention.

With no --model it runs the built-in tiny random video DiT (a 2-layer Wan transformer, a tiny Wan
VAE, random weights from the shipped config) end to end on a CPU in seconds, so it works on any
fresh machine:

    python scripts/generate_video.py                                  # tiny model, NVFP4 (reference numerics on CPU)
    python scripts/generate_video.py --attention compare              # NVFP4 vs dense from the same seed
    python scripts/generate_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --height 480 --width 832 \\
        --frames 81 --steps 50 --guidance-scale 5 --dense-steps 2,2 --out out/wan.mp4
    python scripts/generate_video.py --calibrate                      # per-layer policy, then generate
    python scripts/generate_video.py --policy out/video.policy.json   # reuse a calibrated policy
    torchrun --nproc-per-node 2 scripts/generate_video.py --context-parallel ulysses ...   # 2 GPUs

--context-parallel shards the transformer's sequence over the processes torchrun starts (one per
GPU, NCCL; on a machine without a GPU, CPU processes with gloo) with diffusers' Ulysses or ring
attention; every rank runs the pipeline with the same seed and rank 0 writes the outputs.

Writes the MP4 (diffusers' export_to_video; needs imageio + imageio-ffmpeg) and a JSON next to it
with per-step DiT time, the attention share of each step, peak memory and the sequence lengths of
every attention call (block-sparse calls: their keep_mass, density and the latent grid whose 3D
tiles they ran in).  --attention compare runs dense (sdpa) and NVFP4 from the same seed and
reports the latent cosine / PSNR between them.

Notes: Wan2.2 A14B's two experts (transformer, transformer_2) are both swapped.  Cosmos pipelines
need the `cosmos_guardrail` package (NVIDIA's license requires the safety checker).  MiniMax-H3
ships only as a modular pipeline and is not loadable here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# torch-free: --help and a usage error answer before torch and diffusers are imported (in main)
from nvfp4_dit import cli  # noqa: E402
from nvfp4_dit.defaults import DEFAULT_BUDGET  # noqa: E402


def write_video(frames, path: Path, fps: int) -> None:
    from diffusers.utils import export_to_video

    path.parent.mkdir(parents=True, exist_ok=True)
    export_to_video(list(frames), str(path), fps=fps, macro_block_size=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_generation_args(ap)
    ap.add_argument("--attention", choices=("nvfp4", "sdpa", "compare"), default="nvfp4",
                    help="nvfp4 (default), sdpa (dense baseline), or compare (both from the same seed)")
    ap.add_argument("--out", default="out/video.mp4", help="MP4 path; compare also writes <stem>_sdpa.mp4")
    ap.add_argument("--json", default=None, help="metrics JSON (default: <out>.json)")
    ap.add_argument("--fps", type=int, default=None, help="frames per second of the MP4 (tiny: 8, else 16)")
    ap.add_argument("--no-video", action="store_true", help="skip writing MP4s (JSON only)")
    ap.add_argument("--calibrate", action="store_true",
                    help="first calibrate the policy per layer on one exact run of the same arguments "
                         "(nvfp4_dit.calibrate), write it to <json stem>.policy.json, then generate with it")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"error budget of --calibrate: relative L2 error of each layer's attention output "
                         f"(default {DEFAULT_BUDGET})")
    ap.add_argument("--context-parallel", choices=("ulysses", "ring"), default=None,
                    help="shard the sequence over the ranks of a torchrun launch (Ulysses: heads must divide "
                         "by the rank count; ring: any head count, min_seq_len applies to each shard)")
    args = ap.parse_args(cli.join_pair_values(sys.argv[1:] if argv is None else argv))
    if args.budget is not None and not args.calibrate:
        ap.error("--budget needs --calibrate")
    if args.budget is not None and not args.budget > 0:
        ap.error(f"--budget must be positive, got {args.budget}")
    if args.calibrate and args.policy:
        ap.error("--calibrate writes a policy; it cannot also read one (--policy)")
    if args.context_parallel and args.cpu_offload != "none":
        ap.error("--context-parallel and --cpu-offload cannot be combined (each rank holds its model on its GPU)")

    import torch
    from nvfp4_dit.processors import generation

    device = generation.resolve_device(args)
    rank, world = 0, 1
    if args.context_parallel:
        rank, world, device = generation.init_context_parallel(device)
    ring_shards = world if args.context_parallel == "ring" else 1
    try:
        return _generate(ap, args, device, rank, world, ring_shards)
    finally:
        if args.context_parallel:
            torch.distributed.destroy_process_group()


def _generate(ap, args, device, rank: int, world: int, ring_shards: int) -> int:
    from nvfp4_dit.calibration import format_table
    from nvfp4_dit.processors import generation

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    dtype = generation.resolve_dtype(args, device)
    backend = generation.resolve_backend(args, device)
    t0 = time.perf_counter()
    pipe, defaults, name = generation.load_pipeline(args, device, dtype)
    try:
        generation.check_call(pipe, generation.call_kwargs(pipe, args, defaults, None, None))
    except generation.InvalidArguments as e:
        ap.error(str(e))
    if args.context_parallel:
        if rank != 0:
            pipe.set_progress_bar_config(disable=True)
        sharded = generation.enable_context_parallel(pipe, args.context_parallel)
        say(f"context parallel: {args.context_parallel} over {world} ranks ({', '.join(sharded)})")
    policy = generation.policy_from_args(ap, args, backend, defaults, ring_shards)
    say(f"model: {name} on {device} ({str(dtype).replace('torch.', '')}); attention: {args.attention}; "
        f"policy: {policy.describe()}" + (f" (from {args.policy})" if args.policy else ""))
    out_path = Path(args.out)
    json_path = Path(args.json) if args.json else out_path.with_suffix(".json")
    policy_path = None
    if args.calibrate:
        say("[calibrate] one exact run, every NVFP4 precision measured per layer ...")
        policy = generation.calibrate_pipeline(pipe, args, defaults, policy,
                                               DEFAULT_BUDGET if args.budget is None else args.budget)
        policy_path = json_path.with_name(json_path.stem + ".policy.json")
        if rank == 0:
            policy_path.parent.mkdir(parents=True, exist_ok=True)
            policy.save(policy_path)
        say(format_table(policy))
        say(f"[calibrate] {policy.describe()}; saved to {policy_path}")
    fps = args.fps or defaults.get("fps", 16)

    modes = ["sdpa", "nvfp4"] if args.attention == "compare" else [args.attention]
    report = {"tool": "generate_video", "model": name, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
              "attention": args.attention, "backend": policy.backend, "dense_steps": list(policy.dense_steps),
              "cross_attention": policy.cross_attention, "min_seq_len": policy.min_seq_len,
              "layers": list(policy.layers) if policy.layers else None, "policy": policy.to_dict(),
              "policy_file": str(policy_path or args.policy) if (policy_path or args.policy) else None,
              "prompt": args.prompt, "seed": args.seed, "call": {}, "runs": {},
              "context_parallel": {"mode": args.context_parallel, "world_size": world} if args.context_parallel else None}
    results = {}
    for mode in modes:
        say(f"[{mode}] denoising ...")
        output, summary, latents = generation.run_once(pipe, args, defaults, mode, policy, device)
        frames = generation.frames_of(output)
        results[mode] = (frames, latents)
        video = out_path if (mode == "nvfp4" or len(modes) == 1) else out_path.with_name(out_path.stem + "_sdpa.mp4")
        if not args.no_video and rank == 0:
            write_video(frames, video, fps)
            summary["video"] = str(video)
        summary["frames_shape"] = list(frames.shape)
        report["runs"][mode] = summary
        say(f"[{mode}] {summary['dit_seconds']:.2f} s in the DiT over {len(summary['steps'])} steps, attention "
            f"{100 * (summary['attention_share'] or 0):.1f}% of it; peak memory "
            f"{summary['peak_memory']['bytes'] / 2**20:.0f} MiB ({summary['peak_memory']['kind']})"
            + (f"; video {video}" if not args.no_video else ""))
        if mode == "nvfp4":
            say(f"[{mode}] {generation.describe_paths(summary)}")
    sig = generation.call_kwargs(pipe, args, defaults, None, None)
    report["call"] = {k: v for k, v in sig.items() if isinstance(v, (int, float, str))}
    if args.attention == "compare":
        (fa, la), (fb, lb) = results["sdpa"], results["nvfp4"]
        report["compare"] = generation.compare_metrics(la, lb, fa, fb)
        c = report["compare"]
        say("nvfp4 vs sdpa: " + ", ".join(f"{k} {v:.5g}" for k, v in c.items()))
    report["wall_seconds"] = round(time.perf_counter() - t0, 3)
    if rank == 0:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1, default=float))
    say(f"metrics: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
