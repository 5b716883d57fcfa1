"""Sequence parallelism inside one worker: ComfyUI's own FLUX forward, with each block given this rank's share of the
tokens, and attention gathered across ranks by yunchang's Ulysses all-to-all.

How it gets in without touching ComfyUI's code: FLUX's forward looks up transformer_options["patches_replace"]["dit"]
for every block (as the compiled model's blocks do, blocks.py). The replacement of the first block of each stage
cuts the stage's tokens into one equal share per rank (the last padded with zeros), every block runs on its share,
and the last block of each stage gathers the whole sequence back, so that ComfyUI's code between the stages and after
them (the concatenation of text and image, the final layer) sees what it always sees.

Inside a block everything but attention is per token. Attention gets all tokens through the Ulysses scheme: an
all-to-all trades this rank's tokens of every head for every token of 1/N of the heads (yunchang's SeqAllToAll4D),
the padding is dropped, ComfyUI's attention runs, and a second all-to-all brings the result back. RoPE is applied per
token before attention, so the order of the gathered tokens does not matter; each block gets the positions (`pe`)
of its own tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from yunchang.comm.all_to_all import SeqAllToAll4D

OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's transformer_options key (comfy/ldm/modules/attention.py)
TOKENS = 1  # the token dimension of img, txt (batch, tokens, channels)
PE_TOKENS = 2  # the token dimension of FLUX's positions (batch, 1, tokens, dim/2, 2, 2)


@dataclass
class Split:
    """A sequence made of parts (text then image in a double block; one part in a single block), each part cut into
    `world` shares of `ceil(length / world)` tokens, the last ones padded at their end."""

    lengths: tuple[int, ...]
    rank: int
    world: int
    keep: torch.Tensor = field(init=False)  # real tokens' places in the all-to-all's rank-major sequence

    def __post_init__(self):
        sizes = self.sizes
        share, ranges = sum(sizes), []
        for r in range(self.world):  # rank r's shares follow each other: part p's real tokens start at its offset
            for p, (n, size) in enumerate(zip(self.lengths, sizes)):
                start = r * share + sum(sizes[:p])
                ranges.append(torch.arange(start, start + max(0, min(size, n - r * size))))
        self.keep = torch.cat(ranges)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / self.world) for n in self.lengths)

    def local(self, t: torch.Tensor, part: int, dim: int = TOKENS) -> torch.Tensor:
        """This rank's share of part `part` of `t` (tokens on `dim`), zero-padded to the share's size."""
        size = self.sizes[part]
        mine = t.narrow(dim, min(self.rank * size, t.shape[dim]), max(0, min(size, t.shape[dim] - self.rank * size)))
        if mine.shape[dim] == size:  # a copy with plain strides (a compiled block guards on them, batch's too)
            return mine.clone(memory_format=torch.contiguous_format)
        pad = list(mine.shape)
        pad[dim] = size - mine.shape[dim]
        return torch.cat([mine, mine.new_zeros(pad)], dim=dim)

    def local_all(self, t: torch.Tensor, dim: int = TOKENS) -> torch.Tensor:
        """This rank's share of every part of `t` (its parts one after the other on `dim`), concatenated."""
        parts = torch.split(t, list(self.lengths), dim=dim)
        return torch.cat([self.local(p, i, dim) for i, p in enumerate(parts)], dim=dim)

    def gather(self, t: torch.Tensor, part: int, group=None) -> torch.Tensor:
        """Part `part` whole again, from every rank's share of it (`t`: this rank's, padded)."""
        shares = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(shares, t.contiguous(), group=group)
        return torch.cat(shares, dim=TOKENS).narrow(TOKENS, 0, self.lengths[part])


class UlyssesAttention:
    """The attention override of one stage: q, k, v of this rank's tokens (batch, heads, tokens, dim) in, the
    attention output of these tokens (batch, tokens, heads * dim) out, computed over every rank's tokens by `inner`
    (ComfyUI's attention function, or the override the call had) on 1/world of the heads. One object per stage
    serves every call (a compiled block body sees the same override): `keep` is set for each call's tokens."""

    def __init__(self, world: int, group, inner=None):
        self.world, self.group, self.inner = world, group, inner
        self.keep = torch.zeros(0, dtype=torch.long)  # the call's real tokens in the all-to-all's sequence (Split)

    def __call__(self, func, q, k, v, heads, mask=None, skip_reshape=False, **kwargs):
        b, h, n, d = q.shape if skip_reshape else (q.shape[0], heads, q.shape[1], q.shape[2] // heads)
        if not skip_reshape:
            q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in (q, k, v))
        keep, world = self.keep, self.world
        # (b, h, n, d) -> (b, n, h, d) -> all-to-all -> (b, world * n, h / world, d) -> real tokens -> (b, h', N, d)
        q, k, v = (SeqAllToAll4D.apply(self.group, t.transpose(1, 2).contiguous(), 2, 1, False)[:, keep]
                   .transpose(1, 2) for t in (q, k, v))
        attend = func if self.inner is None else (lambda *a, **kw: self.inner(func, *a, **kw))
        out = attend(q, k, v, h // world, mask=mask, skip_reshape=True, **kwargs)  # (b, N, h' * d)
        full = out.new_zeros(b, world * n, h // world, d)
        full[:, keep] = out.view(b, -1, h // world, d)
        return SeqAllToAll4D.apply(self.group, full, 1, 2, False).reshape(b, n, h * d)


class SequenceParallel:
    """The block replacements of this rank's model calls: `options(transformer_options)` gives a call's options with
    them. `doubles`/`singles`: the model's block counts; `blocks`: a BlockTable whose compiled block bodies run each
    block (None: ComfyUI's own block code). One object serves every call of the worker, so that compiled bodies see
    the same attention override each time."""

    def __init__(self, rank: int, world: int, doubles: int, singles: int, group=None, blocks=None):
        self.rank, self.world, self.doubles, self.singles, self.group = rank, world, doubles, singles, group
        self.blocks = blocks
        self.stage: Split | None = None
        self.pe: torch.Tensor | None = None
        self._attention: dict[tuple, UlyssesAttention] = {}  # (stage, the call's own override) -> override

    def options(self, transformer_options: dict) -> dict:
        replace = {("double_block", i): self._double(i) for i in range(self.doubles)}
        replace.update({("single_block", i): self._single(i) for i in range(self.singles)})
        patches = dict(transformer_options.get("patches_replace", {}))
        patches["dit"] = {**patches.get("dit", {}), **replace}
        return {**transformer_options, "patches_replace": patches}

    def _attending(self, options: dict, stage: str) -> dict:
        inner = options.get(OVERRIDE_KEY)
        att = self._attention.get((stage, id(inner)))
        if att is None:
            att = self._attention[(stage, id(inner))] = UlyssesAttention(self.world, self.group, inner)
        att.keep = self.stage.keep
        return {**options, OVERRIDE_KEY: att}

    def _run(self, key: tuple, args: dict, extra: dict) -> dict:
        """One block on this rank's tokens: its compiled body where there is a block table, else ComfyUI's code."""
        if self.blocks is not None:
            return self.blocks.table()[key](args, extra)
        return extra["original_block"](args)

    def _double(self, i: int):
        def replace(args, extra):
            img, txt = args["img"], args["txt"]
            if i == 0:  # the stage's tokens cut into shares: text then image, as FLUX concatenates them
                self.stage = Split((txt.shape[TOKENS], img.shape[TOKENS]), self.rank, self.world)
                self.pe = self.stage.local_all(args["pe"], PE_TOKENS) if args["pe"] is not None else None
                img, txt = self.stage.local(img, 1), self.stage.local(txt, 0)
            out = self._run(("double_block", i), {**args, "img": img, "txt": txt, "pe": self.pe, "transformer_options":
                                                  self._attending(args["transformer_options"], "double")}, extra)
            if i == self.doubles - 1:
                out = {"img": self.stage.gather(out["img"], 1, self.group),
                       "txt": self.stage.gather(out["txt"], 0, self.group)}
            return out

        return replace

    def _single(self, i: int):
        def replace(args, extra):
            img = args["img"]
            if i == 0:  # text and image as one sequence now
                self.stage = Split((img.shape[TOKENS],), self.rank, self.world)
                self.pe = self.stage.local(args["pe"], 0, PE_TOKENS) if args["pe"] is not None else None
                img = self.stage.local(img, 0)
            out = self._run(("single_block", i), {**args, "img": img, "pe": self.pe, "transformer_options":
                                                  self._attending(args["transformer_options"], "single")}, extra)
            if i == self.singles - 1:
                out = {"img": self.stage.gather(out["img"], 0, self.group)}
            return out

        return replace
