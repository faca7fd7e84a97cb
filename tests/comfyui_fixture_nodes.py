"""Test-only ComfyUI custom node (loaded from a temporary custom_nodes folder by the server test).

The server test has no text encoder, so this stands in for CLIPTextEncode: seeded random
conditioning of a given token count and width.
"""

import torch


class RandomConditioningForTest:
    CATEGORY = "testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
            "tokens": ("INT", {"default": 8, "min": 1, "max": 1024}),
            "width": ("INT", {"default": 4096, "min": 1, "max": 8192}),
        }}

    def make(self, seed, tokens, width):
        generator = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, width, generator=generator), {}]],)


NODE_CLASS_MAPPINGS = {"RandomConditioningForTest": RandomConditioningForTest}
