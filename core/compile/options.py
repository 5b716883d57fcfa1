"""What of a model call's transformer_options reaches the compiled graph. Every key is one of:

  checked  -- per-block patches (CHECKED): the compiled blocks would drop them, so a call that carries any is
              refused, naming them; empty, they are left out (the block table passes its own patches_replace).
              Diffusion-model wrappers run around the compiled call (wrappers.py) and never reach it; one that does
              (a ComfyUI where FluxAccel cannot take them out) is refused the same way
  not read -- the sampler's bookkeeping that ComfyUI's FLUX never reads (NOT_READ: per-call values such as uuids and
              sigmas, which would only add guards); a test reads ComfyUI's FLUX source to keep this list true
  passed   -- everything else goes into the graph: what FLUX reads (rope_options, the attention override) and any
              key FluxAccel does not know, which a later ComfyUI may read (named once in the log). The graph
              guards on what it reads: a changed value compiles again, under the Compile node's shape policy.
"""
from __future__ import annotations

import logging

from ..errors import FluxAccelError
from .attention import OVERRIDE_KEY, sdpa_cudnn_first
from .fp8_attention import sdpa_fp8

log = logging.getLogger("fluxaccel.compile")

CHECKED: tuple[str, ...] = ("patches", "patches_replace", "wrappers")
NOT_READ: tuple[str, ...] = ("cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "multigpu_thread_device",
                             "callbacks")
KNOWN_READ: tuple[str, ...] = ("rope_options", OVERRIDE_KEY, "prefetch_dynamic_vbars")
OWN_ATTENTION = {"cudnn": sdpa_cudnn_first, "fp8": sdpa_fp8}  # FluxAccel's attention overrides, by config name
_named_unknown: set[str] = set()


def unsupported(transformer_options: dict) -> list[str]:
    """Per-block patches and diffusion-model wrappers that the compiled graph would drop."""
    found = [f"{group}.{name}" for group in ("patches", "patches_replace")
             for name, value in (transformer_options.get(group) or {}).items() if value]
    from_wrappers = (transformer_options.get("wrappers") or {}).get("diffusion_model") or {}
    return found + [f"diffusion_model wrapper '{k}'" for k, v in from_wrappers.items() if v]


def refuse_unsupported(transformer_options: dict, kwargs: dict, attention: str = "cudnn") -> None:
    """An error naming what the compiled graph cannot honour in this call; nothing if it can."""
    if attention == "fp8" and kwargs.get("attention_mask") is not None:
        raise FluxAccelError("The Compile node's attention 'fp8' (FlashAttention-3) takes no attention mask, and this "
                             "workflow's conditioning carries one: set attention to 'cudnn' on the Compile node "
                             "(FluxAccel) for this workflow.")
    theirs = transformer_options.get(OVERRIDE_KEY)
    if attention == "fp8" and theirs is not None and theirs not in OWN_ATTENTION.values():
        raise FluxAccelError(f"The Compile node's attention 'fp8' and an attention override another node set "
                             f"({getattr(theirs, '__name__', type(theirs).__name__)}) cannot both run: set attention "
                             f"to 'cudnn' on the Compile node (FluxAccel), or remove the other node.")
    extra = unsupported(transformer_options)
    if extra:
        raise FluxAccelError(
            f"The compiled FLUX model runs its own compiled blocks and would ignore per-block patches: "
            f"{', '.join(extra)}. Apply the node that adds them after removing Compile (FluxAccel), or bypass it.")
    if kwargs.get("ref_latents") is not None and kwargs.get("ref_latents_method") == "index_timestep_zero":
        # ComfyUI 0.33 then modulates the reference tokens per block (modulation_dims), which the compiled blocks'
        # replacement table does not pass: refuse rather than compute without it
        raise FluxAccelError("The compiled FLUX model cannot run reference latents with ref_latents_method "
                             "'index_timestep_zero' (per-token modulation inside the blocks): bypass the Compile node "
                             "(FluxAccel) for this workflow.")


def passed(transformer_options: dict) -> dict:
    """The keys of the call's options that go into the graph (all but CHECKED and NOT_READ)."""
    out = {k: v for k, v in transformer_options.items() if k not in CHECKED and k not in NOT_READ}
    for k in out.keys() - set(KNOWN_READ) - _named_unknown:
        _named_unknown.add(k)
        log.info("FluxAccel: transformer_options[%r] is passed into the compiled graph (a key FluxAccel does not "
                 "know; the graph compiles again if its value changes)", k)
    return out


def attention_override(attention: str):
    """The attention FluxAccel compiles with: cuDNN-first SDPA (attention.py) or FP8 FlashAttention-3
    (fp8_attention.py)."""
    return OWN_ATTENTION[attention]


def call_options(transformer_options: dict, blocks=None, attention=sdpa_cudnn_first) -> dict:
    """The transformer_options of one compiled call: the block table's replacements, the passed keys, and the
    attention FluxAccel compiles with (`attention`, an override) unless the workflow set its own override."""
    opts = blocks.transformer_options() if blocks is not None else {}
    opts.update(passed(transformer_options))
    opts.setdefault(OVERRIDE_KEY, attention)
    return opts
