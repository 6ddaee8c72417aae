"""The norms of megatron-core's CLIP vision encoder on the CPU backend: without Transformer
Engine its default is ``torch.nn.LayerNorm``, which its own ``build_module`` call (it passes
``config=``) cannot construct; megatron's local norm has the signature it expects."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch



def with_local_vit_norms(init: Callable[..., None]) -> Callable[..., None]:
    """``CLIPViTModel.__init__`` whose norms default to megatron's local norm where its own
    default is ``torch.nn.LayerNorm``; a norm the caller names stays."""

    @functools.wraps(init)
    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        for name in ("ln_pre_impl", "ln_post_impl"):
            if kwargs.get(name, torch.nn.LayerNorm) is torch.nn.LayerNorm:
                kwargs[name] = WrappedTorchNorm
        init(self, *args, **kwargs)

    return build
