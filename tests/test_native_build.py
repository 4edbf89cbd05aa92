"""The native kernels' build: C sources only in ``atb_ops/csrc`` (none inside a
``.py`` file), a warning-free build under ``-Werror``, bindings that match the
header's declarations (checked with a real C parser), only the header's
functions exported, a cache key over every source, and a failed build that
reports the compiler's whole output."""

from __future__ import annotations

import ast
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from ascend_fa.atb_ops import native
from ascend_fa.atb_ops.native import (
    CFLAGS,
    CSRC_DIR,
    HEADER,
    NativeKernels,
    build_flags,
    build_library,
    header_prototypes,
    kernel_sources,
    native_kernels,
    native_status,
)

ROOT = Path(__file__).resolve().parents[1]

#: ctypes of the header's scalar types (pointers are c_void_p; void is None).
CTYPES = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "void": None,
}


@pytest.fixture(scope="module")
def kernels():
    status = native_status()
    if not status.available:
        if status.compiler is not None:
            pytest.fail(f"native kernels failed to build: {status.reason}")
        pytest.skip(f"native kernels unavailable: {status.reason}")
    return native_kernels()


def _compiler() -> str:
    cc = native._find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def test_no_c_source_inside_python_files():
    """The kernels live in csrc/*.c: no Python file of the three layers carries C
    (an include, an inline function, an intrinsic type)."""
    c_like = re.compile(
        r"#include\s*[<\"]|\bstatic inline\b|\b__m256i?\b|__attribute__"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for base in ("ascend_fa", "backends", "atb_ops")
        for path in sorted((ROOT / base).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if c_like.search(line)
    ]
    assert not offenders, offenders
    assert {p.name for p in kernel_sources()} >= {"afa_native.h", "cache_write.c"}


def test_build_is_warning_free_under_werror(tmp_path, kernels):
    """CI's build: the default flags (-Wall -Wextra) plus -Werror compile the
    kernels without a single warning, and the result loads and runs."""
    assert {"-Wall", "-Wextra"} <= set(CFLAGS)
    path = build_library(tmp_path, _compiler(), werror=True)
    assert "-Werror" in build_flags(werror=True)
    built = NativeKernels(path)
    assert built.simd == kernels.simd
    codes = built.quantize(torch.tensor([1.0, -2.5, 0.5, 1000.0]), 1.0)
    assert codes.tolist() == [1, -2, 0, 127]


def _pycparser_prototypes() -> dict[str, tuple[object, list[object]]]:
    """The header's prototypes as pycparser reads them (comments and
    preprocessor lines dropped, AFA_API removed, the stdint types typedef'd):
    name -> (ctypes result, ctypes arguments)."""
    c_parser = pytest.importorskip("pycparser.c_parser")
    c_ast = pytest.importorskip("pycparser.c_ast")
    text = HEADER.read_text(encoding="utf-8")
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M).replace("AFA_API", "")
    typedefs = (
        "typedef signed char int8_t; typedef unsigned char uint8_t;"
        "typedef unsigned short uint16_t; typedef int int32_t;"
        "typedef long long int64_t;\n"
    )
    tree = c_parser.CParser().parse(typedefs + text, filename=HEADER.name)

    def ctype(node):
        if isinstance(node, c_ast.PtrDecl):
            return ctypes.c_void_p
        assert isinstance(node, c_ast.TypeDecl), node
        (name,) = node.type.names
        return CTYPES[name]

    protos = {}
    for ext in tree.ext:
        if isinstance(ext, c_ast.Typedef):
            continue
        assert isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.FuncDecl)
        params = ext.type.args.params if ext.type.args else []
        args = [ctype(p.type) for p in params]
        if args == [None]:  # (void)
            args = []
        assert ext.name not in protos, f"{ext.name} declared twice"
        protos[ext.name] = (ctype(ext.type.type), args)
    return protos


def test_bindings_match_the_header_declarations(kernels):
    """Every function of afa_native.h, read by a real C parser, has a binding
    whose restype and argtypes (count and type) are the declaration's; the
    bindings hold nothing else."""
    want = _pycparser_prototypes()
    assert len(want) >= 15
    assert set(want) == set(header_prototypes())
    bound = vars(kernels._lib)
    assert set(bound) == set(want)
    for name, (restype, argtypes) in want.items():
        fn = bound[name]
        assert fn.restype is restype, name
        assert list(fn.argtypes) == argtypes, name
    # the 18 arguments of the decode kernel, one by one
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    assert want["afa_gqa_decode"] == (
        ctypes.c_int,
        [ptr, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64,
         ctypes.c_int, i64, i64, ptr],
    )  # fmt: skip


def test_every_wrapper_calls_a_declared_function():
    """The wrappers in native.py call only functions the header declares, and
    every declared function has a caller (nothing exported for nobody)."""
    tree = ast.parse((ROOT / "atb_ops" / "native.py").read_text(encoding="utf-8"))
    called = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_lib"
    }
    assert called == set(header_prototypes())


def test_library_exports_exactly_the_header_functions(kernels):
    """Built with -fvisibility=hidden, the library exports the AFA_API functions
    and no helper."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    out = subprocess.run(
        [nm, "-D", "--defined-only", native_status().path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = {f[2] for f in (line.split() for line in out.splitlines())
                if len(f) == 3 and f[1] == "T"}  # fmt: skip
    assert exported == set(header_prototypes())


def test_library_points_a_debugger_at_the_sources(kernels):
    """The cached library carries debug info naming the sources in csrc/, which
    stay on disk (nothing is written to and deleted from a temporary file)."""
    blob = Path(native_status().path).read_bytes()
    for source in ("cache_write.c", "fp8.c", "gqa_decode.c", "linear.c"):
        assert (CSRC_DIR / source).is_file()
        assert source.encode() in blob, source
    assert str(CSRC_DIR).encode() in blob


def test_header_parser_is_strict():
    """Anything but an AFA_API prototype of the known types is refused with a
    message naming it; the real header parses."""
    assert header_prototypes()["afa_simd"] == ("int", [])
    ok = "AFA_API int64_t afa_x(const void *p, int n, float s);"
    assert header_prototypes(ok) == {"afa_x": ("int64_t", ["pointer", "int", "float"])}
    for bad, what in (
        ("int afa_x(int n);", "not an AFA_API prototype"),
        ("AFA_API long afa_x(int n);", "not an AFA_API prototype"),
        ("AFA_API int afa_x(double d);", "unsupported parameter"),
        ("AFA_API int afa_x(int);", "unsupported parameter"),
        ("AFA_API int afa_x(struct s *p);", "unsupported parameter"),
        ("AFA_API int afa_x(int8_t c);", "unsupported parameter"),
        ("AFA_API int afa_x(void); AFA_API int afa_x(void);", "declared twice"),
        ("static int helper = 3;", "not an AFA_API prototype"),
        ("/* only a comment */", "no AFA_API prototypes"),
    ):
        with pytest.raises(ValueError, match=what):
            header_prototypes(bad)


def test_sources_refuse_to_build_without_the_constants(tmp_path):
    """The C constants come only from Python's -D flags: a build without them
    stops at an #error saying how to build."""
    cc = _compiler()
    proc = subprocess.run(
        [cc, "-fsyntax-only", f"-I{CSRC_DIR}", str(CSRC_DIR / "linear.c")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "build through ascend_fa.atb_ops.native" in proc.stderr
    for flag in ("-DAFA_ROW_MAX=65536", "-DAFA_ROUND_MAGIC=12582912.0f",
                 "-DAFA_CODE_MIN=-128.0f", "-DAFA_CODE_MAX=127.0f"):  # fmt: skip
        assert flag in build_flags()


def test_failed_build_reports_the_whole_compiler_output(tmp_path):
    """Every line of the compiler's errors reaches the RuntimeError (and the
    status reason), not the first one only; nothing half-built is left."""
    cc = _compiler()
    broken = tmp_path / "broken.h"
    broken.write_text("#error first problem\n#error second problem\n")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError) as info:
        build_library(out, cc, extra_flags=("-include", str(broken)))
    message = str(info.value)
    assert message.startswith(f"{cc} failed (exit ")
    assert "first problem" in message and "second problem" in message
    assert len(message.splitlines()) > 2
    assert not list(out.iterdir())
    status = native.NativeStatus(False, compiler=cc, reason=message)
    assert status.describe().endswith(" ...)")


def test_cache_key_covers_every_source_header_and_the_compiler(tmp_path, monkeypatch):
    """The cached library's name changes with any source or header byte and
    with the compiler, so a changed kernel is never served from the cache."""
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC_DIR, copy)
    monkeypatch.setattr(native, "CSRC_DIR", copy)
    monkeypatch.setattr(native, "HEADER", copy / HEADER.name)
    base = native._library_name("cc 1")
    assert base == native._library_name("cc 1")
    assert base != native._library_name("cc 2")
    names = {base}
    for name in ("afa_native.h", "afa_internal.h", "gqa_decode.c"):
        path = copy / name
        text = path.read_text()
        path.write_text(text + "\n")
        names.add(native._library_name("cc 1"))
        path.write_text(text)
    assert len(names) == 4
    assert native._library_name("cc 1") == base
    (copy / "afa_native.h").unlink()
    with pytest.raises(RuntimeError, match="sources missing"):
        native._library_name("cc 1")


def test_library_missing_a_declared_function_is_refused(tmp_path):
    """A library that lacks a function the header declares does not load: an
    OSError names the function (the loader then rebuilds; load_library fails)."""
    cc = _compiler()
    stub = tmp_path / "stub.c"
    stub.write_text("int afa_simd(void) { return 0; }\n")
    lib = tmp_path / "stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(stub)], check=True)
    with pytest.raises(OSError, match=r"no afa_\w+ \(declared in afa_native.h\)"):
        NativeKernels(lib)
    with pytest.raises(OSError, match="declared in afa_native.h"):
        native.load_library(lib)
