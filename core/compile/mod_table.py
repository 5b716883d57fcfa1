"""The modulation table (on FLUX.1 wherever the model allows it): every block's modulation computed once per prompt,
for all of the sampler's sigmas, instead of at every model call.

A FLUX.1 block's modulation is a Linear of SiLU(vec) with M = 1 (a row per batch entry): at every step each of the 76
modulations reads its whole weight for one row (FLUX.1-dev: 3.2 billion bf16 weights, 6.4 GB per step). `vec` depends only on the timestep, the guidance and the pooled text vector
`y`, and the sampler's sigmas are known before its first call (transformer_options["sample_sigmas"]). So at the first
model call of a sampling run the table computes vec for every sigma and each modulation for all those rows at once:
each weight read once per prompt.

How a call finds its rows, exactly: the table is keyed by the call's inputs, not by values computed from them. At the
start of each call (inside its CUDA graph) `match` compares the call's timestep, guidance and y with the keys, exact
float equality, and writes each batch entry's table row, or -1, into `rows`; after the call `rows` is -1 again (a call
that does not go through the runner, e.g. an uncompiled one, computes every row). The modulation operator copies a
matched row's outputs from the table and reads no weights; for an unmatched row it computes the Linear. A sampler that
calls the model at other sigmas (midpoints), a cond batched differently, or more rows than the table holds: those rows
are computed, counted (the stats' rows_computed), never wrong. The table's values come from a GEMM with more rows
than the call's: they can differ from the per-call Linear in the last bit, as any other kernel choice can.

Where it applies ("auto" leaves it off elsewhere and says why; "on" is refused there): FLUX.1 models whose blocks'
Modulation forward and vector lines FluxAccel read (KNOWN_*: their source's SHA-256), with modulation weights in the
compute dtype, not FP8 (Quantize FP8's scope 'blocks+modulation'). A LoRA on the modulation weights is in them when
the table is built: ComfyUI patches the weights when it loads the model, before the run's first call (weights ComfyUI
patches at every call, lowvram's weight functions, run as ComfyUI's Linear, not looked up). Memory: CAPACITY rows of every modulation's outputs
(FLUX.1-dev: 2.1 MB a row, 134 MB), moved with the model.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import time

import torch
from torch.library import wrap_triton

from ..models import swaps
from ..models.generations import of_model
from ..quant.act_quant import _register as register_triton_op
from .call_graphs import cuda_capture, weight_addresses
from .single_block import source_hash  # SHA-256 of a class's forward source (how single_block knows its forward)

log = logging.getLogger("fluxaccel.compile")

OP_NAME = "fluxaccel::modulation_rows"
CAPACITY = 64  # table rows: sigmas x batch entries of the run's first call
MAX_BATCH = 16  # batch entries a call may have to use the table
# SHA-256 of ComfyUI's Modulation.forward (dedented) and of forward_orig's vector lines -> where they were read
KNOWN_MODULATION = {"6d5295cc94526d674d83e3f5063482a4952fce0e956a161ba71722588803832d": "ComfyUI 0.33.0"}
KNOWN_VECTOR = {"3f5d555d99f0177cfaa7fef829c7a6bf03270e3817f4dcba60a1e35c58cdf8a6": "ComfyUI 0.33.0"}
_VEC_FIRST, _VEC_LAST = "vec = self.time_in(", "vec = vec + self.vector_in("
_FUNCTIONS: dict = {}  # timestep_embedding of the model's module, kept by why_not()


def _live(key: str, module):
    """modulations()'s default: the module in the live tree as it is."""
    return module


def _rows_reference(vec, rows, weight, bias, table):
    r = rows[:vec.shape[0]].long()  # weights cast to the input's dtype, as ComfyUI's ops cast stored weights
    computed = torch.nn.functional.linear(torch.nn.functional.silu(vec), weight.to(vec.dtype),
                                          None if bias is None else bias.to(vec.dtype))
    return torch.where((r >= 0)[:, None], table[r.clamp(min=0)].to(computed.dtype), computed)


def _rows_gpu(vec, rows, weight, bias, table):
    from .mod_table_kernel import modulation_rows_kernel  # imports Triton: only at a GPU call

    b, n = vec.shape[0], weight.shape[0]
    out = torch.empty((b, n), device=vec.device, dtype=vec.dtype)
    block_n = 128
    wrap_triton(modulation_rows_kernel)[(b, -(-n // block_n))](
        vec, rows, weight, weight if bias is None else bias, table, out, n, vec.shape[1], vec.stride(0),
        weight.stride(0), table.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_D=64)
    return out


def _rows_body(vec: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               table: torch.Tensor) -> torch.Tensor:
    if vec.device.type == "cuda":
        return _rows_gpu(vec, rows, weight, bias, table)
    return _rows_reference(vec, rows, weight, bias, table)


_OP, UNAVAILABLE = register_triton_op(OP_NAME, _rows_body)  # as act_quant registers its operators


def modulation_rows(vec: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    table: torch.Tensor) -> torch.Tensor:
    """Linear(SiLU(vec)) of vec (B, D) as (B, N): row b copied from table[rows[b]] where rows[b] >= 0, else computed
    from weight (N, D) and bias (N,)."""
    if _OP is None:
        raise RuntimeError(UNAVAILABLE)
    return _OP(vec, rows, weight, bias, table)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def vector_lines(forward_orig) -> str:
    """The lines of a FLUX forward_orig that make `vec` (from the time embedding to the vector_in term), stripped;
    '' where they cannot be read."""
    try:
        lines = [line.strip() for line in inspect.getsource(forward_orig).splitlines()]
    except (OSError, TypeError):
        return ""
    first = next((i for i, line in enumerate(lines) if line.startswith(_VEC_FIRST)), None)
    last = next((i for i, line in enumerate(lines) if line.startswith(_VEC_LAST)), None)
    return "\n".join(lines[first:last + 1]) if first is not None and last is not None and last > first else ""


def why_not(dm: torch.nn.Module, original=_live) -> str:
    """'' if the table can stand in for this diffusion model's block modulations, else why not (in words).
    original(key, module): as for modulations()."""
    if _OP is None:
        return UNAVAILABLE
    mods = modulations(dm, original)
    if not mods or not all(hasattr(dm, a) for a in ("time_in", "vector_in", "guidance_in", "params")):
        return f"{type(dm).__name__} has no FLUX.1 per-block modulations (FLUX.2 and Chroma modulate otherwise)"
    cls = type(mods[0][1])
    if source_hash(cls) not in KNOWN_MODULATION:
        return f"{cls.__module__}.{cls.__qualname__}.forward is not a modulation forward FluxAccel has read"
    forward_orig = getattr(type(dm), "forward_orig", None)
    if _digest(vector_lines(forward_orig)) not in KNOWN_VECTOR:
        return (f"{type(dm).__module__}.{type(dm).__qualname__}.forward_orig makes its vector in a way FluxAccel has "
                f"not read")
    out_cls = cls.forward.__globals__.get("ModulationOut")
    embedding = forward_orig.__globals__.get("timestep_embedding")
    if out_cls is None or not callable(embedding):
        return f"{cls.__module__} has no ModulationOut, or {type(dm).__module__} no timestep_embedding"
    _FUNCTIONS["timestep_embedding"] = embedding
    return ""


def modulations(dm: torch.nn.Module, original=_live) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every block modulation of a FLUX.1 model (double blocks' img_mod and txt_mod, single blocks'
    modulation): ComfyUI's. original(key, live module): the module without any clone's object patches (the live tree
    may hold another clone's; swaps.original)."""
    out = []
    for i, block in enumerate(getattr(dm, "double_blocks", ()) or ()):
        out += [(f"double_blocks.{i}.{a}", getattr(block, a, None)) for a in ("img_mod", "txt_mod")]
    for i, block in enumerate(getattr(dm, "single_blocks", ()) or ()):
        out.append((f"single_blocks.{i}.modulation", getattr(block, "modulation", None)))
    out = [(name, original(f"diffusion_model.{name}", m)) for name, m in out]
    return out if out and all(m is not None and hasattr(m, "lin") for _, m in out) else []


def _per_call(lin: torch.nn.Module) -> bool:
    """Whether ComfyUI patches this Linear's weight or bias at every call (its weight_function, bias_function)."""
    return bool(getattr(lin, "weight_function", None) or getattr(lin, "bias_function", None))


def _linear_into(out: torch.Tensor, x: torch.Tensor, lin: torch.nn.Module) -> None:
    """out = x @ W.T + b for a Linear with weights as stored (why_not_here() checked them), cast to x's dtype as
    ComfyUI's ops cast stored weights."""
    weight = lin.weight.to(x.dtype).t()
    if lin.bias is None:
        torch.mm(x, weight, out=out)
    else:
        torch.addmm(lin.bias.to(x.dtype), x, weight, out=out)


def _rows_through(dm: torch.nn.Module, modules: list, rows: tuple, dtype: torch.dtype) -> None:
    """The build's device work for `rows` ((timesteps, y rows or None, guidance rows or None)): their vectors, SiLU,
    and each modulation's GEMM into the first rows of its values."""
    s = torch.nn.functional.silu(vectors(dm, *rows, dtype)).to(modules[0].values.dtype)
    for m in modules:
        _linear_into(m.values[:s.shape[0]], s, m.lin)


def _weights_read(dm: torch.nn.Module, modules: list) -> tuple:
    """Where the weights the build reads are: the vector MLPs' and the modulations'."""
    mlps = [getattr(dm, a, None) for a in ("time_in", "guidance_in", "vector_in")]
    return tuple(a for m in (*mlps, *(m.lin for m in modules)) if m is not None for a in weight_addresses(m))


class BuildGraph:
    """The build's device work (_rows_through: the vector MLPs of its rows, then one GEMM per modulation) as one CUDA
    graph over CAPACITY rows on a GPU: one launch where ~120 would delay the run's first call. Captured at the first build, and again where ComfyUI has moved the weights (the graph reads the
    addresses it captured) or the rows come in other dtypes. Elsewhere, or after a failed capture (said once, in the
    stats too), op by op."""

    def __init__(self, capture=None):
        self.capture, self.graph, self.weights, self.inputs, self.layout = capture, None, (), None, None
        self.captures, self.failed = 0, ""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "graph": None, "weights": (), "inputs": None, "layout": None}  # stays in its process

    def __call__(self, dm: torch.nn.Module, modules: list, rows: tuple, dtype: torch.dtype) -> None:
        if self.capture is None or self.failed:
            _rows_through(dm, modules, rows, dtype)
            return
        layout = (dtype, *(None if r is None else (r.dtype, tuple(r.shape[1:]), r.device) for r in rows))
        weights = _weights_read(dm, modules)
        if self.graph is None or weights != self.weights or layout != self.layout:
            if not self._captured(dm, modules, rows, dtype, weights, layout):
                return self(dm, modules, rows, dtype)
        for static, r in zip(self.inputs, rows):
            if r is not None:
                static[:r.shape[0]].copy_(r)
        self.graph.replay()

    def _captured(self, dm, modules: list, rows: tuple, dtype, weights: tuple, layout: tuple) -> bool:
        self.graph = None
        self.inputs = tuple(None if r is None else torch.zeros((CAPACITY, *r.shape[1:]), dtype=r.dtype, device=r.device)
                            for r in rows)  # rows past a run's own keep finite values; their keys never match

        def run():
            _rows_through(dm, modules, self.inputs, dtype)

        try:
            run()  # the first launch of these shapes (cuBLAS's setup), outside the capture
            self.graph, _ = self.capture(run)
        except Exception as e:  # noqa: BLE001 -- said, and its work runs op by op from then on
            self.failed = f"{type(e).__name__}: {e}"[:300]
            log.warning("FluxAccel: modulation table: its build could not be captured in a CUDA graph (%s); it runs "
                        "op by op (a few ms more host work per sampling run)", self.failed)
            return False
        self.weights, self.layout, self.captures = weights, layout, self.captures + 1
        return True


class TableModulation(torch.nn.Module):
    """Stands in for one of ComfyUI's block Modulations: its forward, with the Linear through the table's operator.
    `values` (a buffer: it moves with the model) holds the table's outputs of this Linear; `_table` (not a module)
    the rows of the call running."""

    def __init__(self, original: torch.nn.Module, table: "ModTable", device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.lin, self.is_double, self.multiplier = original.lin, original.is_double, original.multiplier
        n = self.lin.weight.shape[0]  # values in the compute dtype (ComfyUI may store the weights in another)
        self.register_buffer("values", torch.zeros(CAPACITY, n, dtype=dtype, device=device), persistent=False)
        object.__setattr__(self, "_table", table)
        self.cache_tag = f"modulation_table rows={CAPACITY} batch={MAX_BATCH}"  # the compiled graph's shapes (patch.py)
        object.__setattr__(self, "_record", type(original).forward.__globals__["ModulationOut"])

    def forward(self, vec: torch.Tensor) -> tuple:
        if vec.ndim == 2:
            vec = vec[:, None, :]
        if vec.shape[1] != 1 or vec.shape[0] > MAX_BATCH or _per_call(self.lin):
            # a modulation per token, or weights ComfyUI patches at every call: the Linear as ComfyUI calls it
            out = self.lin(torch.nn.functional.silu(vec))
        else:
            out = modulation_rows(vec[:, 0], self._table.rows, self.lin.weight, self.lin.bias, self.values)[:, None]
        out = out.chunk(self.multiplier, dim=-1)
        return self._record(*out[:3]), self._record(*out[3:]) if self.is_double else None


def vectors(dm: torch.nn.Module, timesteps: torch.Tensor, y: torch.Tensor | None, guidance: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """FLUX.1's `vec` for rows of (timestep, y, guidance), as forward_orig's vector lines make it (why_not() read
    them)."""
    embedding = _FUNCTIONS["timestep_embedding"]
    vec = dm.time_in(embedding(timesteps, 256).to(dtype))
    if dm.params.guidance_embed and guidance is not None:
        vec = vec + dm.guidance_in(embedding(guidance, 256).to(dtype))
    if dm.vector_in is not None:
        if y is None:
            y = torch.zeros((timesteps.shape[0], dm.params.vec_in_dim), device=timesteps.device, dtype=dtype)
        vec = vec + dm.vector_in(y[:, :dm.params.vec_in_dim])
    return vec


class ModTable:
    """The keys, the rows of the call running and the counters of one compiled model's modulation table (its values
    are in the TableModulations, `modules`). `timestep_of`: sigma -> the timestep the diffusion model gets."""

    def __init__(self, timestep_of, y_width: int, device: torch.device):
        self.timestep_of, self.y_width, self.modules = timestep_of, y_width, []
        nan = float("nan")  # equal to nothing: a key row not filled never matches
        self.t_keys = torch.full((CAPACITY,), nan, device=device)
        self.g_keys = torch.full((CAPACITY,), nan, device=device)
        self.y_keys = torch.full((CAPACITY, y_width), nan, device=device)
        self.rows = torch.full((MAX_BATCH,), -1, dtype=torch.int32, device=device)
        self.hits = torch.zeros((), dtype=torch.int64, device=device)  # rows matched (counted on the device)
        self.looked, self.builds, self.build_s, self.short, self.patched = 0, 0, 0.0, "", False
        self.run, self.layout = None, None  # the sample_sigmas the table holds, and its first call's batch layout
        self.generations, self.sources, self.built_from = None, (), None  # the weights' generations it was built from
        self.per_call = False  # whether the run's modulation weights are patched at every call (not looked up)
        self.builder = BuildGraph(cuda_capture if torch.device(device).type == "cuda" else None)

    def __getstate__(self) -> dict:
        """Pickled (a separate compile process rebuilds the model from its skeleton) without the sigma-to-timestep
        function (the model's sampling object, which may be a class made inside a function) and the run: another
        process compiles the call, it builds no table."""
        return {**self.__dict__, "timestep_of": None, "run": None, "generations": None}

    def prepare(self, dm, call) -> bool:
        """Before a call (runner.ModelCall; host side): the table built at a sampling run's first call; whether this
        call can look rows up (a run, its weights as stored, and the batch layout of the run's first call)."""
        x, timestep, kwargs = call.x, call.timestep, call.kwargs
        y, guidance, batch = kwargs.get("y"), kwargs.get("guidance"), timestep.shape[0]
        sigmas = call.transformer_options.get("sample_sigmas")
        usable = sigmas is not None and batch <= MAX_BATCH and timestep.ndim == 1
        if usable:
            guidance = guidance if guidance is not None and dm.params.guidance_embed else None
            # the call's batch and its inputs' dtypes (None: not passed, or not read)
            layout = (batch, getattr(y, "dtype", None), getattr(guidance, "dtype", None))
            if sigmas is not self.run or self._weights_written():  # a new run, or its weights written since the build
                self.run, self.layout, self.per_call = sigmas, layout, self._patched_per_call()
                if not self.per_call:
                    self._build(dm, (x.dtype, timestep.dtype), sigmas, batch, y, guidance)
            usable = not self.per_call and layout == self.layout
        self.looked += batch
        return usable

    def _weights_written(self) -> bool:
        """Whether one of the modulation weights the table was built from has been written since (generations.py:
        a LoRA change, a hook keyframe): the one signal, whatever the sigmas."""
        gens = self.generations
        if gens is None or self.built_from is None or gens.version == self.built_from[0]:
            return False
        return tuple(gens[k] for k in self.sources) != self.built_from[1]

    def _patched_per_call(self) -> bool:
        """Whether ComfyUI now patches a modulation weight at every call (a LoRA applied after the Compile node, on a
        model ComfyUI patches per call): those modulations then run as ComfyUI's Linear (TableModulation.forward)
        and no row is looked up; said once."""
        if not any(_per_call(m.lin) for m in self.modules):
            return False
        if not self.patched:
            self.patched = True
            log.warning("FluxAccel: a patch changes the modulation weights at every call (a LoRA applied after the "
                        "Compile node?): the modulation table is not used while it does; apply the LoRA before the "
                        "Compile node to keep it")
        return True

    @torch.no_grad()
    def _build(self, dm, dtypes: tuple, sigmas: torch.Tensor, batch: int, y, guidance) -> None:
        """The keys and values of a run. Each input keeps the dtype the call gets it in (ComfyUI casts the guidance
        to the model's dtype, and FLUX's embedding multiplies it by 1000 in that dtype: 3.5 gives 3504 in bf16)."""
        t0 = time.perf_counter()
        so_far = self._so_far()  # reads the device's counter now, while the GPU is idle, not after the build's work
        waited = time.perf_counter() - t0
        dtype, t_dtype = dtypes  # the model's (the latent's) and the timestep's
        ts = self.timestep_of(sigmas.to(self.t_keys.device)).float().to(t_dtype).flatten()
        steps = min(ts.shape[0], CAPACITY // batch)
        self.short = "" if steps == ts.shape[0] else \
            f"the table holds {steps} of the run's {ts.shape[0]} sigmas at batch {batch}; the rest are computed"
        if self.short:
            log.info("FluxAccel: modulation table: %s", self.short)
        n = steps * batch
        t = ts[:steps].repeat_interleave(batch)  # row r: sigma r // batch, batch entry r % batch
        y_rows = None if y is None else y[:, :self.y_width].repeat(steps, 1)
        g_rows = None if guidance is None else guidance.flatten().repeat(steps)
        if self.generations is not None:
            self.built_from = (self.generations.version, tuple(self.generations[k] for k in self.sources))
        self.builder(dm, self.modules, (t, y_rows, g_rows), dtype)  # one GEMM per modulation: weights read once a run
        for keys, rows in ((self.t_keys, t), (self.g_keys, g_rows), (self.y_keys, y_rows)):
            keys.fill_(float("nan"))
            if rows is not None:
                keys[:n] = rows.float()
            elif keys is not self.t_keys:
                keys[:n] = 0.0  # not part of this run's calls: matched against 0 where the call passes nothing
        self.builds += 1
        self.build_s += time.perf_counter() - t0
        log.info("FluxAccel: modulation table built for %d rows (%d sigmas x batch %d) in %.1f ms (host, %.1f ms of "
                 "it waiting for the GPU's counter); so far %d rows looked up, %d computed", n, steps, batch,
                 1e3 * (time.perf_counter() - t0), 1e3 * waited, *so_far)

    def _so_far(self) -> tuple[int, int]:
        hits = int(self.hits.item())  # waits for the GPU: once per sampling run, at its first call
        return hits, self.looked - hits

    def match(self, timestep: torch.Tensor, kwargs: dict) -> None:
        """Each batch entry's table row (or -1) into `rows`, on the device (a CUDA graph replays it)."""
        eq = timestep.float()[:, None] == self.t_keys[None]
        guidance, y = kwargs.get("guidance"), kwargs.get("y")
        if guidance is not None and self.layout[2] is not None:
            eq &= guidance.float().flatten()[:, None] == self.g_keys[None]
        if y is not None:
            eq &= (y[:, :self.y_width].float()[:, None, :] == self.y_keys[None]).all(-1)
        hit = eq.any(1)
        self.rows[:eq.shape[0]] = torch.where(hit, eq.to(torch.int32).argmax(1), -1).to(torch.int32)
        self.hits += hit.sum()

    def around(self, fn, used: bool):
        """fn with its call's rows looked up first (where `used`) and -1 again after it."""
        if not used:
            return fn

        def call(x, timestep, **kwargs):
            self.match(timestep, kwargs)
            try:
                return fn(x, timestep, **kwargs)
            finally:
                self.rows.fill_(-1)

        return call

    def counts(self) -> dict:
        """The stats' figures (reads the device's counter)."""
        hits, computed = self._so_far()
        return {"rows_from_table": hits, "rows_computed": computed, "builds": self.builds,
                "build_s": round(self.build_s, 3), "build_graphs": self.builder.captures,
                "build_graph_failed": self.builder.failed, "capacity_rows": CAPACITY, "short": self.short,
                "patched_per_call": self.patched}


def why_not_here(model, dm: torch.nn.Module) -> str:
    """'' if the table can stand in for this model's block modulations, else why not and what to change."""
    original = functools.partial(swaps.original, model)
    why = why_not(dm, original)
    if why:
        return why
    mods = modulations(dm, original)
    keys = [f"diffusion_model.{name}" for name, _ in mods]
    fp8 = sorted(k for k, _ in swaps.items(model) if any(k.startswith(f"{p}.") for p in keys))
    if fp8:
        return (f"Quantize FP8 quantized its modulation weights ({fp8[0]}, ...; scope 'blocks+modulation'); Quantize "
                f"FP8's scope 'blocks' keeps them for the table")
    if not callable(getattr(getattr(getattr(model, "model", None), "model_sampling", None), "timestep", None)):
        return "its model has no model_sampling.timestep (sigma to timestep)"
    for key, (_, m) in zip(keys, mods):
        lin = m.lin
        if lin.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
                getattr(lin, "weight_function", None) or getattr(lin, "bias_function", None):
            return (f"{key}.lin holds {lin.weight.dtype} weights or changes them per call (the table needs them as "
                    f"stored)")
    return ""


def for_clone(clone, model, dm: torch.nn.Module, device: torch.device,
              earlier: ModTable | None = None) -> tuple[ModTable | None, str]:
    """(the table installed on `clone`, '') where `model` allows it -- `earlier`, the table of a compiled model this
    clone reuses, where one is given; else (None, why) -- '' also where the architecture has no per-block
    modulations, so nothing to say."""
    why = why_not_here(model, dm)
    if why:
        return None, f"{why}; each call computes its modulations" if modulations(dm) else ""
    if earlier is not None:
        swaps.add(clone, earlier.swapped)
        return earlier, ""
    return install(clone, model, dm, device), ""


def install(clone, model, dm: torch.nn.Module, device: torch.device) -> ModTable:
    """A table for `clone` (a clone of `model` the Compile node made, why_not_here() ''): each block modulation
    swapped for a TableModulation through an object patch (the input model and other branches keep ComfyUI's)."""
    table = ModTable(model.model.model_sampling.timestep, dm.params.vec_in_dim, device)
    table.generations = of_model(model.model)  # rebuilt when one of its weights is written (a LoRA, a hook keyframe)
    swapped, sources = {}, []
    for name, original in modulations(dm, functools.partial(swaps.original, model)):
        # ComfyUI computes in its manual-cast dtype where it stores weights in another (e.g. bf16 weights on a CPU)
        dtype = getattr(model.model, "manual_cast_dtype", None) or original.lin.weight.dtype
        swapped[f"diffusion_model.{name}"] = m = TableModulation(original, table, device, dtype)
        table.modules.append(m)
        sources += [f"diffusion_model.{name}.lin.{p}" for p in ("weight", "bias") if getattr(m.lin, p, None) is not None]
    table.sources = tuple(sources)
    swaps.add(clone, swapped)  # one object patch per block, with the FP8 Linears already swapped there
    table.swapped = swapped  # what another clone of the compiled model gets (for_clone's `earlier`)
    return table
