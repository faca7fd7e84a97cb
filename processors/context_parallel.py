"""Context parallelism (Ulysses or ring) of a diffusers model with NVFP4 attention.

diffusers' engine does the distributed work: ``ContextParallelConfig``, the split/gather hooks of
the model's ``_cp_plan``, Ulysses all-to-all and ring attention merging K/V chunks by their LSE.
The NVFP4 paths take part without anything of their own: the ``"nvfp4"`` backend is registered
as context-parallel capable (its forward op returns the true LSE), and the processors of
:func:`~nvfp4_dit.processors.apply.apply` forward ``_parallel_config`` to both their FP4 and
their dense path.

:func:`enable_context_parallel` is ``model.enable_parallelism(config=ContextParallelConfig(...))``
where that works (one accelerator per rank).  Without an accelerator (CPU processes with the gloo
backend: tests, debugging) ``enable_parallelism`` cannot place a rank on a device (it takes
``rank % torch.accelerator.device_count()``), so the same steps run through diffusers'
lower-level functions: ``ParallelConfig.setup`` on a CPU device mesh, ``_parallel_config`` on
every processor, ``hooks.context_parallel.apply_context_parallel`` with the model's plan.

Launch one process per GPU (``torchrun --nproc-per-node 2 ...``); every rank runs the whole
pipeline with the same inputs and seed and gets the whole output.  What the numerics are:

* Ulysses: each rank attends over the full sequence for ``heads / world size`` heads.  FP4
  quantisation is per head, so the attention output is the single-GPU one bit for bit.
* Ring: each rank attends its query shard to one K/V shard at a time.  Each shard is quantised
  with its own statistics (K and V means, tensor scales, channel balance), so the output differs
  from the single-GPU one by about the FP4 error itself, not more.  The policy's ``min_seq_len``
  is compared with the shard lengths.  A block-sparse policy (``keep_mass``) runs ring calls
  dense: a shard is no 3D box of the video, and its estimate would see only a part of each row's
  mass.  Ulysses calls see the whole sequence and run block-sparse as on one GPU.
"""

from __future__ import annotations

import torch

MODES = ("ulysses", "ring")


def _has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    return acc is not None and acc.is_available() and acc.device_count() > 0


def context_parallel_config(mode: str):
    """A diffusers ``ContextParallelConfig`` for ``mode`` over every rank of the process group."""
    from diffusers import ContextParallelConfig

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised first "
                           "(torch.distributed.init_process_group; torchrun sets up the environment)")
    world = torch.distributed.get_world_size()
    if world < 2:
        raise ValueError(f"context parallelism needs at least 2 ranks, the process group has {world}")
    return ContextParallelConfig(**{f"{mode}_degree": world})


def enable_context_parallel(model: torch.nn.Module, mode: str):
    """Shard ``model``'s sequence over the ranks of the default process group.

    Args:
        model: a diffusers model with a context-parallel plan (``_cp_plan``: Wan, LTX-Video,
            MiniMax-H3, ...), on this rank's device.  Call it before or after
            :func:`nvfp4_dit.apply`; both orders reach the NVFP4 processors.
        mode: "ulysses" (all-to-all over heads; the head count must divide by the world size)
            or "ring" (K/V passed around; any head count).

    Returns:
        The model's diffusers ``ParallelConfig``.

    Raises:
        RuntimeError without an initialised process group or when the model is already parallel;
        ValueError for a bad ``mode``, a model without a plan, or (Ulysses) a head count
        the world size does not divide.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a diffusers model (nn.Module), got {type(model).__name__}")
    cp_config = context_parallel_config(mode)
    plan = getattr(model, "_cp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan (_cp_plan); diffusers cannot "
                         "shard its sequence")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if mode == "ulysses" and isinstance(heads, int) and heads % cp_config.ulysses_degree:
        raise ValueError(f"mode='ulysses' splits the {heads} attention heads of {type(model).__name__} over "
                         f"{cp_config.ulysses_degree} ranks, which does not divide them; use mode='ring'")
    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError(f"{type(model).__name__} is already parallel (enable_parallelism was called)")
    if _has_accelerator():
        model.enable_parallelism(config=cp_config)
        return model._parallel_config
    return _enable_on_cpu(model, cp_config, plan)


def _enable_on_cpu(model: torch.nn.Module, cp_config, plan):
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp_config)
    config.setup(rank, world, torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is not None and hasattr(proc, "_parallel_config"):
            proc._parallel_config = config
    apply_context_parallel(model, cp_config, plan)
    return config
