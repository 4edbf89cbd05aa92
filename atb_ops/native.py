"""Native CPU kernels (paged cache write, FP8 blocks, GQA decode, static W8A8
epilogues), built from the C sources in ``csrc/`` on first use.

The kernels are plain C with no torch headers (``csrc/*.c``; every exported
function is declared once in ``csrc/afa_native.h``, and each source file says what
its kernels compute and why they equal the eager torch path bit for bit). They
compile in a few seconds with the system C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``) into one shared library, cached on disk under a name derived from
the sources, the flags, the compiler and the machine, and loaded with
:mod:`ctypes`; the bindings' argument and return types are read from the header,
so Python and C cannot disagree. The AVX2 + F16C path is chosen at run time from
the CPU's feature bits, so the cached file also runs on an older x86 CPU (scalar
path). No compiler, a failed compile (:attr:`NativeStatus.reason` holds the
compiler's whole message) or ``ASCEND_FA_NATIVE=0`` leaves the eager torch path in
use; :func:`native_status` says which path runs and why.

The build passes ``-Wall -Wextra`` (and the tests build once more with
``-Werror``: a warning fails CI, while a user's newer compiler that warns still
gets the kernels); :func:`build_library` takes extra flags for a sanitizer or
debugging build, and :func:`load_library` puts such a library in use. See
``docs/developer/native-kernels.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import settings
from .constants import INT8_MAX, INT8_MIN, ROUND_MAGIC

__all__ = [
    "NATIVE_ENV",
    "NATIVE_CACHE_ENV",
    "MAX_ROW_BYTES",
    "CSRC_DIR",
    "HEADER",
    "CFLAGS",
    "LDFLAGS",
    "WERROR_FLAGS",
    "SANITIZE_FLAGS",
    "NativeStatus",
    "build_flags",
    "build_library",
    "header_prototypes",
    "kernel_sources",
    "load_library",
    "native_disabled",
    "native_enabled",
    "native_status",
    "native_kernels",
    "NativeKernels",
]

#: Environment switch: ``0`` keeps the eager torch path (the kernels are not built).
NATIVE_ENV = "ASCEND_FA_NATIVE"
#: Directory for the compiled library (default: ``$XDG_CACHE_HOME/ascend_fa`` or
#: ``~/.cache/ascend_fa``; then ``<tmp>/ascend_fa-<uid>``). Only a directory of the
#: current user that group and others cannot write is used (the library runs as the
#: caller).
NATIVE_CACHE_ENV = "ASCEND_FA_NATIVE_CACHE"
#: Widest token row (bytes of int8 codes) the kernel stages on its stack.
MAX_ROW_BYTES = 65536

#: The kernels' C sources (package data): ``*.c`` and the headers they include.
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
#: The one declaration of every exported function (the bindings are read from it).
HEADER = CSRC_DIR / "afa_native.h"

#: Optimisation only; no flag that relaxes IEEE semantics (no -ffast-math), and no
#: contraction of a product and a sum into one FMA: the division, the products and
#: the rounding must be the exact IEEE operations the eager path performs. ``-g``
#: costs nothing at run time and lets a debugger show the sources (kept on disk in
#: ``csrc/``); ``-fvisibility=hidden`` exports only what the header marks AFA_API.
CFLAGS = (
    "-O3",
    "-g",
    "-fPIC",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-std=gnu99",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
)
#: The link of the objects into one shared library.
LDFLAGS = ("-shared",)
#: Added by the tests' build (CI): any compiler warning fails it.
WERROR_FLAGS = ("-Werror",)
#: AddressSanitizer + UndefinedBehaviorSanitizer, every report fatal (the slow
#: suite's sanitizer run; a later ``-O1`` overrides ``CFLAGS``' ``-O3``).
SANITIZE_FLAGS = (
    "-O1",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)

#: Input dtype codes of the kernels (``dtype`` arguments in afa_native.h).
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _defines() -> tuple[str, ...]:
    """The constants the C sources take from Python, as ``-D`` flags (the sources
    refuse to build without them)."""
    return (
        f"-DAFA_ROW_MAX={MAX_ROW_BYTES}",
        f"-DAFA_ROUND_MAGIC={float(ROUND_MAGIC)!r}f",
        f"-DAFA_CODE_MIN={float(INT8_MIN)!r}f",
        f"-DAFA_CODE_MAX={float(INT8_MAX)!r}f",
    )


def build_flags(werror: bool = False, extra_flags: Sequence[str] = ()) -> list[str]:
    """The compiler flags of a build: :data:`CFLAGS`, the ``-D`` constants, the
    include directory, ``-Werror`` when ``werror``, then ``extra_flags`` (later
    flags win, so ``-O0`` there makes a debug build)."""
    return [
        *CFLAGS,
        *_defines(),
        f"-I{CSRC_DIR}",
        *(WERROR_FLAGS if werror else ()),
        *extra_flags,
    ]


def kernel_sources() -> list[Path]:
    """The files a build reads, sorted: every ``csrc/*.c`` (compiled) and
    ``csrc/*.h`` (included); all of them enter the library's cache key."""
    files = sorted([*CSRC_DIR.glob("*.c"), *CSRC_DIR.glob("*.h")])
    if not any(f.suffix == ".c" for f in files) or not HEADER.is_file():
        raise RuntimeError(f"native kernel sources missing from {CSRC_DIR}")
    return files


#: Scalar C types of afa_native.h and their ctypes (``void`` only as a result);
#: every pointer is passed as ``c_void_p`` (the wrappers hand over data_ptr()).
_C_SCALARS: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_C_POINTEES = ("void", "int8_t", "uint8_t", "uint16_t", "int32_t", "float")
_PROTO = re.compile(r"AFA_API (?P<ret>\w+) (?P<name>afa_\w+)\((?P<params>[^()]*)\)")
_PARAM = re.compile(r"(?:const )?(?P<type>\w+) ?(?P<ptr>\*?) ?(?P<name>\w+)")


def header_prototypes(text: str | None = None) -> dict[str, tuple[str, list[str]]]:
    """The exported functions of ``afa_native.h`` (or ``text``): name -> (result
    type, parameter types), each type a C scalar of :data:`_C_SCALARS` or
    ``"pointer"``. Strict: anything in the header besides comments, preprocessor
    lines and ``AFA_API`` prototypes of those types is a ``ValueError`` naming it
    (the bindings must never guess)."""
    if text is None:
        text = HEADER.read_text(encoding="utf-8")
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)
    protos: dict[str, tuple[str, list[str]]] = {}
    for decl in text.split(";"):
        decl = " ".join(decl.replace("*", " * ").split())
        decl = decl.replace("( ", "(").replace(" )", ")").replace(" (", "(")
        if not decl:
            continue
        m = _PROTO.fullmatch(decl)
        if m is None or m["ret"] not in _C_SCALARS:
            raise ValueError(f"{HEADER.name}: not an AFA_API prototype: {decl!r}")
        params: list[str] = []
        if m["params"].strip() != "void":
            for p in m["params"].split(","):
                pm = _PARAM.fullmatch(p.strip())
                ok = pm is not None and (
                    pm["type"] in _C_POINTEES
                    if pm["ptr"]
                    else pm["type"] in _C_SCALARS and pm["type"] != "void"
                )
                if not ok:
                    raise ValueError(
                        f"{HEADER.name}: {m['name']}: unsupported parameter {p!r}"
                    )
                params.append("pointer" if pm["ptr"] else pm["type"])
        if m["name"] in protos:
            raise ValueError(f"{HEADER.name}: {m['name']} declared twice")
        protos[m["name"]] = (m["ret"], params)
    if not protos:
        raise ValueError(f"{HEADER.name}: no AFA_API prototypes")
    return protos


def _ctype(c_type: str) -> type | None:
    return ctypes.c_void_p if c_type == "pointer" else _C_SCALARS[c_type]


@dataclass(frozen=True)
class NativeStatus:
    """Which path the native kernels' callers take on CPU and why.

    ``available``: the native library is loaded; ``compiler``: the C compiler used;
    ``compile_s``: seconds this process spent compiling it (0 when it was loaded
    from the disk cache, ``from_cache``); ``simd``: the AVX2 + F16C path is used;
    ``reason``: why the eager path runs when not available (a failed build's whole
    compiler output)."""

    available: bool
    path: str | None = None
    compiler: str | None = None
    compile_s: float = 0.0
    from_cache: bool = False
    simd: bool = False
    reason: str = ""

    def describe(self) -> str:
        """One line for benchmark output (a multi-line reason: its first line)."""
        if not self.available:
            lines = self.reason.splitlines() or [""]
            more = " ..." if len(lines) > 1 else ""
            return f"eager torch ({lines[0]}{more})"
        how = (
            "loaded from the disk cache"
            if self.from_cache
            else f"compiled in {self.compile_s:.2f} s"
        )
        isa = "AVX2+F16C" if self.simd else "scalar"
        return f"native C ({isa}, {self.compiler}, {how})"


def native_enabled() -> bool:
    """False when ``ASCEND_FA_NATIVE=0`` (read on every call, so a test or a
    benchmark can switch paths in-process)."""
    return bool(settings.get(NATIVE_ENV))


@contextlib.contextmanager
def native_disabled() -> Iterator[None]:
    """Run the block on the eager torch path (``ASCEND_FA_NATIVE=0``, restored
    on exit)."""
    before = os.environ.get(NATIVE_ENV)
    os.environ[NATIVE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NATIVE_ENV, None)
        else:
            os.environ[NATIVE_ENV] = before


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def _cache_dir() -> Path:
    env = settings.get(NATIVE_CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "ascend_fa"


def _private_dir(directory: Path) -> str | None:
    """Make ``directory`` (mode 0700) and check that only this user can put a
    library there: a real directory (not a symlink), owned by the current user,
    not writable by group or others. Returns why not, or None. A library loaded
    with ``ctypes`` runs with the caller's rights, so a directory someone else can
    write (a shared temp dir, a planted symlink) is never used."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory}: not a directory (a symlink is not followed)"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{directory}: owned by another user"
    if st.st_mode & 0o022:
        return f"{directory}: writable by group or others"
    return None


def _own_file(path: Path) -> bool:
    """``path`` is a regular file (not a symlink) of the current user that
    group and others cannot write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and (not hasattr(os, "getuid") or st.st_uid == os.getuid())
        and not st.st_mode & 0o022
    )


def _cache_dirs() -> list[Path]:
    """Where the library may be cached: the user's cache directory, then a
    per-user directory in the temp dir (``ascend_fa-<uid>``, mode 0700)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [_cache_dir(), Path(tempfile.gettempdir()) / f"ascend_fa-{uid}"]


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _library_name(ident: str) -> str:
    """The cached library's file name: a hash of every source file (name and
    bytes), the flags, the compiler's identity and the machine."""
    h = hashlib.sha256()
    for path in kernel_sources():
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    flags = [*build_flags(), *LDFLAGS, ident, platform.machine()]
    h.update("\0".join(flags).encode())
    return f"afa_native_{h.hexdigest()[:16]}.so"


def _run_all(cmds: list[list[str]], timeout: float) -> list[tuple[int, str]]:
    """Run the commands at once; (exit status, stderr + stdout) of each. Raises
    ``RuntimeError`` when one cannot start or runs past ``timeout`` seconds (all
    of them are then stopped)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for cmd in cmds:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            text = "\n".join(t.strip() for t in (err, out) if t.strip())
            results.append((proc.returncode, text))
        return results
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{cmds[0][0]} could not run: {exc}") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def build_library(
    directory: str | os.PathLike[str],
    cc: str | None = None,
    *,
    werror: bool = False,
    extra_flags: Sequence[str] = (),
) -> Path:
    """Compile the kernels (``csrc/*.c``, read in place) into a new library in
    ``directory`` (a fresh build, no cache lookup) and return its path. ``werror``
    adds ``-Werror``; ``extra_flags`` come last (e.g. :data:`SANITIZE_FLAGS`, or
    ``-O0`` for a debugger). The sources compile side by side (one compiler
    process each), then link. Raises ``RuntimeError`` with the compiler's whole
    output (every failing source's) when there is no compiler or it fails;
    nothing is left behind. Used by :func:`native_kernels`, the tests and the
    benchmark (the cold compile cost)."""
    cc = cc or _find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    sources = [p for p in kernel_sources() if p.suffix == ".c"]
    flags = build_flags(werror, extra_flags)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="afa_native_", suffix=".so", dir=directory)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="afa_obj_", dir=directory) as objs:
            objects = [str(Path(objs) / f"{src.stem}.o") for src in sources]
            results = _run_all(
                [[cc, *flags, "-c", "-o", o, str(src)]
                 for src, o in zip(sources, objects)],
                timeout=300,
            )  # fmt: skip
            if all(rc == 0 for rc, _ in results):
                # the sanitizers' runtimes come in through the link
                link = [f for f in flags if f.startswith("-fsanitize")]
                cmd = [cc, *LDFLAGS, *link, "-o", tmp, *objects]
                results = _run_all([cmd], timeout=300)
            errors = [(rc, text) for rc, text in results if rc != 0]
            if errors:
                raise RuntimeError(
                    f"{cc} failed (exit {errors[0][0]}) building the native kernels"
                    f" from {CSRC_DIR}:\n" + "\n".join(text for _, text in errors)
                )
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


class NativeKernels:
    """The loaded library with typed wrappers (pointers come from tensors the
    caller has validated: contiguous, CPU, the dtypes named). Every function's
    ctypes argument and result types come from ``csrc/afa_native.h``
    (:func:`header_prototypes`); only declared functions are reachable."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        lib = ctypes.CDLL(str(path))
        fns = {}
        for name, (ret, params) in header_prototypes().items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise OSError(
                    f"{path}: no {name} (declared in {HEADER.name})"
                ) from None
            fn.restype = _ctype(ret)
            fn.argtypes = [_ctype(p) for p in params]
            fns[name] = fn
        self._dll = lib
        self._lib = types.SimpleNamespace(**fns)
        self.simd = bool(self._lib.afa_simd())

    def set_simd(self, enabled: bool) -> bool:
        """Use the AVX2 + F16C path when the CPU has it (``True``, the default) or
        the portable scalar path (``False``, what a CPU without AVX2 runs); returns
        whether the SIMD path is now in use."""
        self._lib.afa_set_simd(int(enabled))
        self.simd = bool(self._lib.afa_simd())
        return self.simd

    def set_explicit_rounding(self, enabled: bool) -> None:
        """Make the AVX2 quantizer round with an explicit round-to-nearest-even
        instruction (``True``: the path a thread whose MXCSR rounds otherwise
        takes) instead of the conversion under the default MXCSR (``False``, the
        default); both give the same codes, the tests run both."""
        self._lib.afa_set_explicit_round(int(enabled))

    def set_product(self, enabled: bool) -> None:
        """Let the AVX2 quantizer multiply by the reciprocal for scales whose
        product codes were verified equal on every 16-bit input (``True``, the
        default) or always divide (``False``); the tests run both."""
        self._lib.afa_set_product(int(enabled))

    def product_exact(self, scale: float, dtype: torch.dtype) -> bool | None:
        """Whether the quantizer runs the verified product path for ``scale`` and
        16-bit ``dtype`` on this thread (None: no AVX2 path or another dtype)."""
        code = _DTYPE_CODES.get(dtype, -1)
        rc = self._lib.afa_product_exact(scale, code if code in (0, 1) else -1)
        return None if rc < 0 else bool(rc)

    def quant_write(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        run_bytes: int,
    ) -> None:
        """Quantize ``x`` ``[T, H, D]`` (contiguous) by ``scale`` ``[H]`` fp32 into
        the int8 ``cache``; ``run_bytes`` 0 for ND, the fractal row bytes for NZ."""
        t, h, d = x.shape
        rc = self._lib.afa_quant_write(
            x.data_ptr(),
            _DTYPE_CODES[x.dtype],
            t,
            h,
            d,
            scale.data_ptr(),
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            cache.data_ptr(),
            block_size,
            run_bytes,
        )
        if rc != 0:
            raise ValueError(f"row of {h * d} codes exceeds {MAX_ROW_BYTES} bytes")

    def repeated_slot(
        self, slots: torch.Tensor, num_slots: int, block_size: int
    ) -> int | None | bool:
        """The smallest slot that contiguous int32/int64 ``slots`` ``[T]`` lists
        twice (negative slots skipped; every slot must be ``< num_slots``), None
        when none, or False when the kernel does not decide (a pattern other than
        whole blocks on a cache too large for one bit per slot; the caller sorts)."""
        n = slots.numel()
        # one bit per slot costs num_slots / 8 bytes zeroed: allowed while that
        # stays within a small multiple of the slots' own bytes
        rc = self._lib.afa_repeated_slot(
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            n,
            num_slots,
            block_size,
            max(1 << 16, 64 * n),
        )
        if rc >= 0:
            return int(rc)
        return None if rc == -1 else False

    def copy_write(
        self,
        x: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        run_bytes: int,
    ) -> None:
        """Copy the rows of ``x`` ``[T, ...]`` (contiguous, the cache dtype)."""
        t = x.shape[0]
        self._lib.afa_copy_write(
            x.data_ptr(),
            t,
            x[0].numel() * x.element_size() if t else 0,
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            cache.data_ptr(),
            block_size,
            run_bytes,
        )

    def fp8_dequantize(
        self,
        codes: torch.Tensor,
        scale_inv: torch.Tensor,
        block: tuple[int, int],
        lut: torch.Tensor,
        out: torch.Tensor,
    ) -> tuple[str, int] | None:
        """``out [r, n]`` (bf16 or fp16, contiguous) = ``(codes.float() *
        scale_inv).to(out.dtype)`` for contiguous ``codes [r, n] float8_e4m3fn`` and
        fp32 ``scale_inv [ceil(r/BR), ceil(n/BC)]``; ``lut`` is the fp32 value of
        each of the 256 codes. Returns None, or ``("nan", k)`` for the first NaN
        code at flat index ``k`` / ``("overflow", k)`` for the first fp16 result
        that is not finite (``out`` is then partly written), or ``("unsupported",
        -1)`` (fp16 output without F16C: nothing written)."""
        r, n = codes.shape
        kind = 0 if out.dtype == torch.bfloat16 else 1
        rc = self._lib.afa_fp8_dequantize(
            codes.data_ptr(),
            r,
            n,
            scale_inv.data_ptr(),
            block[0],
            block[1],
            lut.data_ptr(),
            out.data_ptr(),
            kind,
        )
        if rc == -1:
            return None
        if rc == -3:
            return ("unsupported", -1)
        return ("overflow" if rc % 2 else "nan", rc // 2)

    def fp8_quantize(
        self,
        w: torch.Tensor,
        block: tuple[int, int],
        scale_inv: torch.Tensor,
        codes: torch.Tensor,
    ) -> int | None:
        """Block-quantize contiguous ``w [r, n]`` (fp16, bf16 or fp32) into
        contiguous ``codes [r, n] float8_e4m3fn`` and fp32 ``scale_inv
        [ceil(r/BR), ceil(n/BC)]``, equal to the eager rule bit for bit. Returns
        None, the flat index of the first block holding inf or NaN (row-major), or
        -1 when this thread's float environment is not the default one (MXCSR
        rounding or flush-to-zero changed: nothing written, the caller runs the
        eager path)."""
        r, n = w.shape
        rc = self._lib.afa_fp8_quantize(
            w.data_ptr(),
            _DTYPE_CODES[w.dtype],
            r,
            n,
            block[0],
            block[1],
            scale_inv.data_ptr(),
            codes.data_ptr(),
        )
        return None if rc == -1 else (-1 if rc == -2 else int(rc))

    def fp8_e4m3(self, x: torch.Tensor) -> torch.Tensor | None:
        """The kernels' fp32 -> float8_e4m3fn conversion of contiguous fp32 ``x``
        (exposed so tests can sweep it against torch's cast); None outside the
        default float environment."""
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        rc = self._lib.afa_fp8_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
        return None if rc == -2 else out

    def gqa_decode(
        self,
        q: torch.Tensor,
        coef: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        num_kv_heads: int,
        nz: bool,
        out: torch.Tensor,
        seqs: tuple[int, int],
    ) -> int:
        """Decode sequences ``[b0, b1)`` of contiguous fp32 ``q`` ``[B, H, D]``
        against the int8 caches (each block contiguous, blocks ``stride(0)``
        apart) through contiguous int32 ``table`` ``[B, n]`` and ``lens`` ``[B]``,
        into contiguous fp32 ``out`` ``[B, H, D]`` (before the V scale); ``coef``
        ``[H]`` fp32 is the score factor.
        Returns 0 or the kernel's error code (see
        ``atb_ops/csrc/gqa_decode.c``)."""
        _, h, d = q.shape
        bs = key_cache.shape[2] if nz else key_cache.shape[1]
        return int(
            self._lib.afa_gqa_decode(
                q.data_ptr(),
                coef.data_ptr(),
                key_cache.data_ptr(),
                key_cache.stride(0),
                value_cache.data_ptr(),
                value_cache.stride(0),
                min(key_cache.shape[0], value_cache.shape[0]),
                bs,
                table.data_ptr(),
                table.shape[1],
                lens.data_ptr(),
                num_kv_heads,
                h,
                d,
                int(nz),
                seqs[0],
                seqs[1],
                out.data_ptr(),
            )  # fmt: skip
        )

    def static_codes(
        self, x: torch.Tensor, scale: float, offset: float, div: bool
    ) -> torch.Tensor | None:
        """``static_codes`` of contiguous CPU ``x`` (fp16, bf16 or fp32) with fp32
        ``scale`` / ``offset``: int8 of ``x``'s shape, or None outside the default
        float environment (see ``atb_ops/csrc/linear.c``)."""
        out = torch.empty(x.shape, dtype=torch.int8)
        rc = self._lib.afa_static_codes(
            x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), scale, offset,
            int(div), out.data_ptr(),
        )  # fmt: skip
        return None if rc != 0 else out

    def static_dequant(
        self,
        acc: torch.Tensor,
        quant_bias: torch.Tensor | None,
        deq: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """``static_dequant`` of contiguous int32 ``acc`` ``[M, N]`` with int32
        ``quant_bias`` ``[N]`` (or None) and fp32 ``deq`` ``[N]`` into bf16 or
        fp32; None outside the default float environment."""
        m, n = acc.shape
        out = torch.empty(m, n, dtype=out_dtype)
        rc = self._lib.afa_static_dequant(
            acc.data_ptr(), m, n,
            None if quant_bias is None else quant_bias.data_ptr(), deq.data_ptr(),
            int(out_dtype == torch.bfloat16), out.data_ptr(),
        )  # fmt: skip
        return None if rc != 0 else out

    def int_gemm(
        self,
        x_q: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        cols: tuple[int, int],
    ) -> int:
        """Columns ``[cols[0], cols[1])`` of ``x_q @ weight^T`` (contiguous int8
        ``[M, K]`` and ``[N, K]``) into contiguous int32 ``out`` ``[M, N]``, exact
        (see ``atb_ops/csrc/int_gemm.c``). Returns 0 or the kernel's error code."""
        m, k = x_q.shape
        n = weight.shape[0]
        return int(
            self._lib.afa_int_gemm(
                x_q.data_ptr(),
                m,
                weight.data_ptr(),
                k,
                n,
                cols[0],
                cols[1],
                out.data_ptr(),
            )  # fmt: skip
        )

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """The kernel's quantizer alone: codes of contiguous ``x`` under one scale
        (what the write stores; exposed so tests can sweep every input value)."""
        out = torch.empty(x.shape, dtype=torch.int8)
        self._lib.afa_quantize(
            x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), scale, out.data_ptr()
        )
        return out


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _load() -> tuple[NativeKernels | None, NativeStatus]:
    if sys.platform not in ("linux", "darwin"):
        return None, NativeStatus(False, reason=f"no native kernels on {sys.platform}")
    cc = _find_compiler()
    if cc is None:
        return None, NativeStatus(False, reason="no C compiler ($CC, cc, gcc, clang)")
    ident = _compiler_id(cc)
    try:
        header_prototypes()
        name = _library_name(ident)
    except (OSError, RuntimeError, ValueError) as exc:
        return None, NativeStatus(False, compiler=ident, reason=str(exc))
    reason = ""
    for directory in _cache_dirs():
        unsafe = _private_dir(directory)
        if unsafe is not None:
            reason = unsafe
            continue
        target = directory / name
        if target.is_file() and _own_file(target):
            try:
                kernels = NativeKernels(target)
            except OSError:
                pass  # damaged or foreign file: rebuild it below
            else:
                return kernels, NativeStatus(
                    True, str(target), ident, 0.0, True, kernels.simd
                )
        start = time.perf_counter()
        try:
            built = build_library(directory, cc)
        except (OSError, RuntimeError) as exc:
            reason = str(exc)
            continue
        elapsed = time.perf_counter() - start
        # atomic: another process building the same library concurrently either
        # sees the finished file or builds its own
        os.replace(built, target)
        kernels = NativeKernels(target)
        return kernels, NativeStatus(
            True, str(target), ident, elapsed, False, kernels.simd
        )
    return None, NativeStatus(False, compiler=ident, reason=reason)


def _loaded() -> tuple[NativeKernels | None, NativeStatus]:
    with _LOCK:
        if "status" not in _STATE:
            _STATE["kernels"], _STATE["status"] = _load()
        return _STATE["kernels"], _STATE["status"]  # type: ignore[return-value]


def load_library(path: str | os.PathLike[str]) -> NativeStatus:
    """Use the library at ``path`` (one :func:`build_library` made, e.g. with
    :data:`SANITIZE_FLAGS` or ``-O0`` for a debugger) for the rest of this process
    instead of the cached one; returns the new status. Raises ``OSError`` when it
    cannot be loaded."""
    kernels = NativeKernels(path)
    status = NativeStatus(True, str(path), None, 0.0, False, kernels.simd)
    with _LOCK:
        _STATE["kernels"], _STATE["status"] = kernels, status
    return status


def native_kernels() -> NativeKernels | None:
    """The loaded kernels (built on the first call of the process), or None when
    disabled (``ASCEND_FA_NATIVE=0``) or unavailable."""
    if not native_enabled():
        return None
    return _loaded()[0]


def native_status() -> NativeStatus:
    """Which path the native kernels' callers take (loads the kernels if
    enabled)."""
    if not native_enabled():
        return NativeStatus(False, reason=f"{NATIVE_ENV}=0")
    return _loaded()[1]
