"""Compile a Triton kernel for a GPU target on a CPU-only machine and return its PTX.

The tests run kernels in the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py), where
``triton.jit`` gives interpreted functions that cannot be compiled; so compilation runs in a
fresh Python process with the interpreter off.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

_SCRIPT = r"""
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
spec = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec["aligned"]}
if spec["gluon"]:
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
else:
    src = triton.compiler.ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
options = {"num_warps": spec["num_warps"], "num_stages": spec["num_stages"], **spec["options"]}
compiled = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options=options)
sys.stdout.write(json.dumps({"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}))
"""


_DESCRIPTOR_DTYPES = {"float8_e4m3fn": "fp8e4nv", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def descriptor_type(descriptor) -> str:
    """The signature type of a Gluon ``TensorDescriptor`` argument (what a launch with it specializes
    to), so a compile test takes its descriptors from the launcher itself."""
    dtype = _DESCRIPTOR_DTYPES[str(descriptor.base.dtype).removeprefix("torch.")]
    return f"tensordesc<{dtype}[{', '.join(map(str, descriptor.block_shape))}],{descriptor.layout!r}>"


# Shared memory one program may use on Hopper (H100 / H200: 227 KB); a kernel that needs more compiles
# but fails at launch.
HOPPER_SHARED_BYTES = 232448


def compile_ptx(*args, **kwargs) -> str:
    """PTX of a kernel compiled for a GPU target (the arguments of :func:`compile_kernel`)."""
    return compile_kernel(*args, **kwargs)[0]


def compile_kernel(module: str, kernel: str, signature: dict, constexprs: dict, *, arch: int = 90,
                   num_warps: int = 4, num_stages: int = 2, aligned=(), options=None,
                   gluon: bool = False) -> tuple[str, int]:
    """(PTX, shared-memory bytes a launch needs) of ``module.kernel`` compiled for ``sm_{arch}``.

    ``signature`` maps every non-constexpr argument to a Triton type string (``"*fp8e4nv"``,
    ``"i32"``, ...) and constexpr arguments to ``"constexpr"``; ``constexprs`` gives their values.
    ``aligned`` names the arguments to compile as divisible by 16, as a real launch specializes
    pointers and integers that are; ``options`` adds compile options (e.g. ``{"maxnreg": 128}``);
    ``gluon`` for a ``gluon.jit`` kernel (tensor descriptors as ``"tensordesc<dtype[block],layout>"``).
    """
    spec = dict(module=module, kernel=kernel, signature=signature, constexprs=constexprs, arch=arch,
                num_warps=num_warps, num_stages=num_stages, aligned=list(aligned), options=options or {}, gluon=gluon)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(spec)], capture_output=True, text=True,
                            env=env, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_{arch} failed:\n{result.stderr[-4000:]}")
    compiled = json.loads(result.stdout)
    return compiled["ptx"], compiled["shared"]


def divides(ptx: str) -> bool:
    """Whether ``ptx`` has a floating-point division (rounded, full-range or approximate): the MX
    scale bytes come from the maxima's bits (``mx_format.rceil_scale_byte``), never from ``amax / 448``."""
    return any(f"div.{kind}" in ptx for kind in ("rn.f32", "full.f32", "approx"))


def ptxas_report(ptx: str, arch: int = 90) -> str:
    """What Triton's own ptxas says (``-v``: registers, spills, performance notes) assembling ``ptx``
    for ``sm_{arch}a``."""
    return _assemble(ptx, arch)[0]


def sass(ptx: str, arch: int = 90) -> str:
    """The SASS that Triton's own ptxas makes of ``ptx`` for ``sm_{arch}a``, as its nvdisasm prints it
    (``-c``: code only, one instruction per line, branch targets as ``.L_x_N`` labels)."""
    return _assemble(ptx, arch)[1]


@functools.lru_cache(maxsize=4)  # a test reads both the report and the SASS of one PTX: assemble it once
def _assemble(ptx: str, arch: int) -> tuple[str, str]:
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        result = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", source, "-o", cubin],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"ptxas failed:\n{result.stderr[-4000:]}")
        nvdisasm = os.path.join(os.path.dirname(get_ptxas(arch).path), "nvdisasm")
        code = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, timeout=600, check=True)
    return result.stderr, code.stdout


def innermost_loops(code: str) -> list[list[str]]:
    """The instructions of each innermost loop of a :func:`sass` listing: from a label to a branch back
    to it, with no such pair inside."""
    lines = code.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line.strip())}
    spans = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            spans.append((labels[target.group(1)], i))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [[x for x in lines[a:b + 1] if "/*" in x and ";" in x] for a, b in innermost]

