"""Builds csrc/cuda's kernels for the CPU emulator of csrc/cuda_emu/cuda_emu.h.

The kernel sources are translated where g++ cannot read CUDA (kernel launches and ``__shared__``
declarations; everything else compiles as it is against the emulator's stand-ins for the CUDA
headers), then compiled with csrc/bindings_cuda.cpp into a module ``_C_cuda`` with the same
functions as the real one. Builds are cached under build/cuda_emu/<hash of every input>.

    python tests/cuda_emu/build.py     # build (or find) the module and print its path
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
EMU = CSRC / "cuda_emu"
HERE = Path(__file__).resolve().parent
CACHE = ROOT / "build" / "cuda_emu"

KERNEL_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))
SELFTEST_SOURCES = [HERE / "selftest_kernels.cu"]
FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-mf16c",
    # The kernels reinterpret 16-byte vectors as half2 pairs, as CUDA code does; nvcc keeps
    # such accesses, g++ under strict aliasing may not.
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-parameter",
    "-Wno-unused-function",
]

_LABEL_COLON = re.compile(r"(?<!:):(?!:)")
_LAUNCH = re.compile(r"<<<(.*?)>>>\s*\(", re.S)
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
_STATIC_SHARED = re.compile(r"__shared__\s+([^;=\[]*?)\s+(\w+)\s*((?:\[[^\]]*\]\s*)+);")


def translate(source: str) -> str:
    """The CUDA source with its launches and __shared__ declarations in emulator terms; line
    numbers are kept (errors point at the original file through a #line directive)."""
    source = _DYNAMIC_SHARED.sub(
        lambda m: f"{m[1]}* {m[2]} = ::pagedserve_emu::dynamic_shared<{m[1]}>();", source
    )
    source = _STATIC_SHARED.sub(
        lambda m: (
            f"static {m[1]} {m[2]}{m[3].rstrip()}; "
            f"::pagedserve_emu::shared_declared({m[2]}, sizeof({m[2]}));"
        ),
        source,
    )
    if "__shared__" in source:
        raise ValueError("a __shared__ declaration the translation does not know")
    out, position = [], 0
    for match in _LAUNCH.finditer(source):
        # The kernel expression runs back from <<< to the end of the previous statement; its
        # text (newlines included) is kept, so later lines keep their numbers.
        head = source[position : match.start()]
        cut = max(head.rfind(";"), head.rfind("{"), head.rfind("}")) + 1
        labels = list(_LABEL_COLON.finditer(head, cut))  # `case 4:` or `default:`
        if labels:
            cut = labels[-1].end()
        kernel = head[cut:].lstrip()
        if not kernel.strip():
            raise ValueError(f"no kernel before <<< at offset {match.start()}")
        rest = source[match.end() :].lstrip()
        comma = "" if rest.startswith(")") else ", "
        between = match[0][match[0].rindex(">>>") + 3 : -1]  # whitespace before the "("
        out.append(head[: len(head) - len(kernel)])
        label = " ".join(kernel.split()).replace("\\", "").replace('"', "")
        launch = f'::pagedserve_emu::Launcher({match[1]}).run("{label}", {kernel}{comma}{between}'
        out.append(launch)
        position = match.end()
    out.append(source[position:])
    return "".join(out)


def _python_includes() -> list[str]:
    import pybind11

    return [pybind11.get_include(), sysconfig.get_paths()["include"]]


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _digest(paths: list[Path], flags: list[str]) -> str:
    digest = hashlib.sha256()
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    digest.update(version.encode())
    digest.update(" ".join(flags).encode())
    for path in sorted(paths):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _build(name: str, sources: list[Path], bindings: Path) -> Path:
    inputs = [
        *sources,
        bindings,
        Path(__file__).resolve(),
        *EMU.rglob("*.h"),
        *(CSRC / "cuda").glob("*.cuh"),
        *CSRC.glob("*.h"),
        *HERE.glob("*.h"),
    ]
    out_dir = CACHE / f"{name}-{_digest(inputs, FLAGS)}"
    module = out_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if module.exists():
        return module
    out_dir.mkdir(parents=True, exist_ok=True)
    includes = [EMU / "include", CSRC, CSRC / "cuda", HERE, *_python_includes()]
    include_flags = [f"-I{path}" for path in includes]
    jobs = []
    for source in sources:
        translated = out_dir / (source.stem + ".cpp")
        text = translate(source.read_text())
        translated.write_text(f'#line 1 "{source}"\n{text}')
        jobs.append((translated, out_dir / (source.stem + ".o")))
    jobs.append((bindings, out_dir / (bindings.stem + ".o")))

    def compile_one(job: tuple[Path, Path]) -> subprocess.CompletedProcess:
        source, obj = job
        command = [_compiler(), *FLAGS, *include_flags, "-c", str(source), "-o", str(obj)]
        return subprocess.run(command, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, jobs))
    for (source, _), result in zip(jobs, results):
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source} for the emulator failed:\n{result.stderr}")
    partial = module.with_suffix(f".partial{os.getpid()}")
    link = [_compiler(), "-shared", *FLAGS, *(str(obj) for _, obj in jobs), "-o", str(partial)]
    result = subprocess.run(link, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"linking {module.name} failed:\n{result.stderr}")
    partial.rename(module)  # whole or absent: a build stopped halfway is not reused
    for stale in CACHE.glob(f"{name}-*"):  # builds of earlier sources
        if stale != out_dir:
            shutil.rmtree(stale, ignore_errors=True)
    return module


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emulated_kernels() -> ModuleType:
    """csrc/cuda's kernels and csrc/bindings_cuda.cpp, built for the emulator (``_C_cuda``)."""
    return _load("_C_cuda", _build("_C_cuda", KERNEL_SOURCES, CSRC / "bindings_cuda.cpp"))


def emulator_selftest() -> ModuleType:
    """Kernels that break CUDA's rules on purpose, and correct ones, to test the emulator."""
    bindings = HERE / "selftest_bindings.cpp"
    return _load("_cuda_emu_selftest", _build("_cuda_emu_selftest", SELFTEST_SOURCES, bindings))


if __name__ == "__main__":
    sys.stdout.write(f"{emulated_kernels().__file__}\n{emulator_selftest().__file__}\n")
