"""The platform seam: every compiler- or platform-specific lever jaxformer pulls, by name, and where it is on.

A lever changes how a program is laid out or compiled, never what it computes (each one's test compares with
it off). It is on only for the platforms where it was measured to pay; everywhere else the code is plain jax
(`jnp.einsum`, `jax.nn`, XLA's own defaults). Today every lever was measured on XLA:CPU only, so every lever is
off for "gpu" and "tpu". Each lever names the results file and row that measured it; timings live there. The
accelerator levers (chunked_loss onwards) are built and tested for equal results, and on nowhere until a GPU run
of `benchmarks/gpu.py` measures them: turn one on by name with `override`.

    platforms.levers("cpu")       -> {"weight_grad": True, ...}     every lever, on or off there
    platforms.enabled("weight_grad")                                   the current platform's choice (or override)
    with platforms.override(weight_grad=False): ...                    A/B one lever (benchmarks), by name
    platforms.in_force()          -> {"platform": "cpu", "levers": {...}}   what a training run records

Choices are read while a program is traced: a jitted function built and traced inside `override` keeps the
choice it was traced with. The platform is jax's default backend (`jax.default_backend()`). A training
run records the choices it starts with (`in_force`) in RUN/levers.jsonl (`jaxformer.runs`); evaluating or
decoding records nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jaxformer.errors import ConfigError

PLATFORMS = ("cpu", "gpu", "tpu")
GPU_ROW = "benchmarks/results/gpu.md, levers: "


@dataclasses.dataclass(frozen=True)
class Lever:
    what: str
    measured: str            # the results file (and row) that measured it
    on: tuple[str, ...]      # the platforms it is on for


LEVERS = {
    "copy_insertion": Lever(
        "the train step compiled with copy insertion's region analysis "
        "(xla_cpu_copy_insertion_use_region_analysis): fewer copies of a loop's carried values",
        "benchmarks/results/levers.md, copy_insertion", ("cpu",)),
    "threefry_unrolled": Lever(
        "jax.random's threefry2x32 lowered as straight-line code (as GPU and TPU lower it), not a 5-trip loop",
        "benchmarks/results/levers.md, threefry_unrolled", ("cpu",)),
    "weight_order_dot": Lever(
        "a projection as one dot_general contracting in the weight's own axis order (nn.params.contract; "
        "jnp.einsum may order them otherwise, and XLA:CPU then copies the weight at every call); off: jnp.einsum",
        "benchmarks/results/decode_profile.md (copies per token)", ("cpu",)),
    "weight_grad": Lever(
        "each projection's weight gradient as one standard-form matmul whose smaller operand is transposed "
        "(nn.params.contract's custom VJP, platforms.cpu.materialize); off: jax's transpose of the dot",
        "benchmarks/results/levers.md, weight_grad", ("cpu",)),
    "tiled_transpose": Lever(
        "that transposed operand moved in 32x32 tiles (platforms.cpu.transpose); off: x.T",
        "benchmarks/results/levers.md, tiled_transpose", ("cpu",)),
    "softmax_gemv": Lever(
        "the attention softmax's backward row sums as a matmul with a ones vector (ops.dot_product_attention's "
        "softmax_grad='gemv'); off: jax.nn.softmax's own backward", "benchmarks/results/levers.md, softmax_gemv",
        ("cpu",)),
    "cache_write_order": Lever(
        "each layer's new keys/values made to depend on its attention output (+ 0 x one element), so that a token "
        "loop updates the cache in place", "benchmarks/results/decode_profile.md (copies per token)", ("cpu",)),
    "decode_fused_qkv": Lever(
        "in a token loop, a self-attention's q/k/v weights as one matrix (one matmul per step)",
        "benchmarks/results/decode.md (the decode step against PyTorch)", ("cpu",)),
    "decode_w2_out_in": Lever(
        "in a token loop over one row, an FFN's output weight stored [out,in] (read row by row)",
        "benchmarks/results/levers.md, decode_w2_out_in", ("cpu",)),
    # accelerator levers: built and tested for equal results on CPU, on nowhere until `benchmarks/gpu.py`
    # measures them on a GPU (its "levers" section A/Bs each by name)
    "chunked_loss": Lever(
        "the training loss from the output head's input, the logits made one sequence slice at a time and "
        "rematerialised (ops.losses.chunked_token_losses): no [B,T,V] float32 logits", GPU_ROW + "chunked_loss", ()),
    "unrolled_layers": Lever(
        "the layer stack's scan fully unrolled (jax.lax.scan unroll=True): one straight-line program of L layers "
        "(XLA may overlap and fuse across layers; longer compiles)", GPU_ROW + "unrolled_layers", ()),
    "fused_projections": Lever(
        "a self-attention's q/k/v projections as one matmul over their concatenated weights, and a gated FFN's "
        "gate/up likewise (the weights stay separate parameters)", GPU_ROW + "fused_projections", ()),
    "gpu_latency_hiding": Lever(
        "the train step compiled with xla_gpu_enable_latency_hiding_scheduler", GPU_ROW + "gpu_latency_hiding", ()),
    "gpu_no_triton_gemm": Lever(
        "the train step compiled with xla_gpu_enable_triton_gemm=false (cuBLAS for every matmul)",
        GPU_ROW + "gpu_no_triton_gemm", ()),
    "gpu_no_command_buffers": Lever(
        "the train step compiled with xla_gpu_enable_command_buffer empty (no CUDA graphs)",
        GPU_ROW + "gpu_no_command_buffers", ()),
    "gpu_while_double_buffering": Lever(
        "the train step compiled with xla_gpu_enable_while_loop_double_buffering (the layer scan's next "
        "iteration's reads overlapped with this one's compute)", GPU_ROW + "gpu_while_double_buffering", ()),
}

# The XLA compiler options each option lever adds to the train step (`lowering.train_compiler_options`).
COMPILER_OPTIONS = {
    "gpu_latency_hiding": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "gpu_no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    "gpu_no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    "gpu_while_double_buffering": {"xla_gpu_enable_while_loop_double_buffering": True},
}

_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("jaxformer_levers", default={})


def _check(names) -> None:
    unknown = sorted(set(names) - set(LEVERS))
    if unknown:
        raise ConfigError(f"unknown lever(s) {', '.join(unknown)}; the levers are {', '.join(LEVERS)}")


def levers(platform: str) -> dict[str, bool]:
    """Every lever and whether it is on for `platform` ("cpu", "gpu", "tpu"; overrides not applied)."""
    if platform not in PLATFORMS:
        raise ConfigError(f"platform={platform!r} is not one of {PLATFORMS}")
    return {name: platform in lever.on for name, lever in LEVERS.items()}


def current() -> str:
    """The platform programs are traced for now: jax's default backend ("cuda"/"rocm" read as "gpu")."""
    import jax
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm", "gpu") else backend


def enabled(name: str) -> bool:
    """Whether lever `name` is on for the current platform, or as `override` set it."""
    over = _overrides.get()
    if name in over:
        return over[name]
    _check([name])
    return current() in LEVERS[name].on


def in_force() -> dict:
    """The choices a program traced now gets: {"platform": `current()`, "levers": {name: `enabled(name)`} for
    every lever} (overrides applied), JSON-ready."""
    return {"platform": current(), "levers": {name: enabled(name) for name in LEVERS}}


@contextlib.contextmanager
def override(**choices: bool):
    """Turn levers on or off by name while the block runs (programs traced inside it keep the choice)."""
    _check(choices)
    token = _overrides.set({**_overrides.get(), **{k: bool(v) for k, v in choices.items()}})
    try:
        yield
    finally:
        _overrides.reset(token)
