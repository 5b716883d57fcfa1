"""FluxAccel's forward of a FLUX single block: ComfyUI's, without the concatenation written before linear2.

ComfyUI's SingleStreamBlock ends with `linear2(torch.cat((attn, mlp_act(mlp)), 2))`. With Quantize FP8's fused
activation (quant/act_fusion.py: GELU, or FLUX.2's SiLU gate) linear2 applies it and quantizes its input row by row in
one kernel, but the concatenation is still written out first (FLUX.1-dev 1024²: 4608 rows of 15,360 values per block,
38 blocks; FLUX.2 [dev]: 24,576 + 18,432 values, 48 blocks). Here linear2 reads the attention output and the MLP
stream where they are (quant/act_quant.py's two-input kernels): the same numbers, one full read and write of the row
fewer.

The forward below is ComfyUI's, line for line but for that call, so it runs only where:
  * the block's class has a forward whose source is one FluxAccel read (KNOWN, by its SHA-256; another ComfyUI
    keeps its own forward, and the Compile node says so), and the functions it calls come from that class's module;
  * its linear2 is a plain-layout FP8 Linear with dynamic scales and the fused activation starting at the attention
    output's end (quant/linear.py takes_pair) and its mlp_act is the Identity put in the activation's place;
  * the blocks run through the block table (blocks.py).
Anything else runs the block's own forward.
"""
from __future__ import annotations

import hashlib
import inspect
import textwrap

import torch

from ..quant.linear import takes_pair
from ..quant.patch import fp8_state

# SHA-256 of SingleStreamBlock.forward's source (dedented) -> where it was read
KNOWN = {"0a79a7f4b0ed0598aaa39388484046d2eca88c48e67e5f6917dab984f3b551b6": "ComfyUI 0.33.0"}
_CALLS = ("apply_mod", "attention")  # the module-level functions the forward calls, taken from the class's module
_FUNCTIONS: dict = {}  # name -> function of the known class's module, filled by known() before any trace


def source_hash(cls: type) -> str:
    """SHA-256 of cls.forward's source, dedented; '' where Python cannot read it."""
    try:
        return hashlib.sha256(textwrap.dedent(inspect.getsource(cls.forward)).encode()).hexdigest()
    except (OSError, TypeError, AttributeError):
        return ""


def known(cls: type) -> str:
    """'' if cls.forward is a single-block forward FluxAccel read (its module's functions kept for forward()), else
    why not, in words. Not to be called in a trace (it reads source files)."""
    digest = source_hash(cls)
    if digest not in KNOWN:
        return (f"{cls.__module__}.{cls.__qualname__}.forward is not a single-block forward FluxAccel has read (read: "
                f"{', '.join(sorted(KNOWN.values()))})")
    functions = getattr(cls.forward, "__globals__", {})
    missing = [name for name in _CALLS if not callable(functions.get(name))]
    if missing:
        return f"{cls.__module__} has no {', '.join(missing)}"
    _FUNCTIONS.update({name: functions[name] for name in _CALLS})
    return ""


def cache_tag(dm: torch.nn.Module) -> str:
    """What the compiled single blocks depend on (the compile cache's key): the source of the forward FluxAccel's
    stands in for."""
    blocks = getattr(dm, "single_blocks", None)
    return f"single_blocks=fluxaccel:{source_hash(type(blocks[0]))[:16] or 'unreadable' if blocks else 'none'}"


def why_off(model, dm: torch.nn.Module) -> str:
    """Where Quantize FP8 fused the single blocks' MLP activation into linear2 (a clone of `model`, whose diffusion
    model is `dm`) but forward() cannot run on this ComfyUI: why, with what runs instead ('' otherwise)."""
    blocks = getattr(dm, "single_blocks", None)
    state = fp8_state(model)
    if not blocks or state is None or "diffusion_model.single_blocks.0.mlp_act" not in state.fused_keys:
        return ""
    why = known(type(blocks[0]))
    return f"{why}; ComfyUI's forward runs (linear2's concatenated input is written first)" if why else ""


def ready(block: torch.nn.Module) -> bool:
    """Whether this block (of a known class) can run forward(): linear2 takes the attention output and the MLP
    stream apart, and the activation it applies is no longer applied before it."""
    return (isinstance(block.mlp_act, torch.nn.Identity) and not getattr(block, "yak_mlp", False)
            and takes_pair(block.linear2, block.hidden_size))


def forward(block, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006 (ComfyUI's)
    """ComfyUI 0.33.0's SingleStreamBlock.forward with `linear2(torch.cat((attn, mlp), 2))` as one FP8 call on the
    two parts (mlp_act is the Identity: linear2 applies the activation)."""
    apply_mod, attention = _FUNCTIONS["apply_mod"], _FUNCTIONS["attention"]
    mod = block.modulation(vec)[0] if block.modulation else vec
    patches = transformer_options.get("patches", {})
    extra_options = transformer_options.copy()
    qkv, mlp = torch.split(block.linear1(apply_mod(block.pre_norm(x), (1 + mod.scale), mod.shift, modulation_dims)),
                           [3 * block.hidden_size, block.mlp_hidden_dim_first], dim=-1)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, block.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = block.norm(q, k, v)
    for p in patches.get("attn1_patch", ()):
        out = p(q, k, v, pe=pe, attn_mask=attn_mask, extra_options=extra_options)
        q, k, v = out.get("q", q), out.get("k", k), out.get("v", v)
        pe, attn_mask = out.get("pe", pe), out.get("attn_mask", attn_mask)
    attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
    for p in patches.get("attn1_output_patch", ()):
        attn = p(attn, extra_options)
    output = block.linear2.fp8_forward_pair(attn, mlp)
    x += apply_mod(output, mod.gate, None, modulation_dims)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x
