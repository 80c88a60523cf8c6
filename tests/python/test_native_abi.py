"""dos._native against client/include/dos/dos.h: the header is parsed here
and every enum value, struct field and function signature of the ctypes
binding must match it (a change to dos.h that is not mirrored in
dos/_native.py fails this test)."""

import ctypes
import os
import re

import pytest

from dos import _native

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "client", "include", "dos", "dos.h")


def _source(path=HEADER):
    with open(path) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)


def _enum(name):
    m = re.search(r"typedef\s+enum\s+%s\s*\{(.*?)\}\s*%s\s*;" % (name, name), _source(), re.S)
    assert m, f"dos.h has no enum {name}"
    out = {}
    for item in m.group(1).split(","):
        k, v = item.split("=")
        out[k.strip()] = int(v.strip())
    return out


def _structs(path=HEADER):
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", _source(path), re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if decl:
                fm = re.fullmatch(r"(.*?[\s*])(\w+)", decl)
                fields.append((fm.group(2), _norm(fm.group(1))))
        out[m.group(1)] = fields
    return out


def _functions():
    out = {}
    src = _source()
    for m in re.finditer(r"([\w\s\*]+?)\b(dos_\w+)\s*\(([^)]*)\)\s*;", src):
        ret = _norm(m.group(1).split(";")[-1].split("}")[-1])
        args = [] if m.group(3).strip() in ("", "void") else [
            _norm(re.fullmatch(r"(.*?[\s*])(\w+)", " ".join(a.split())).group(1))
            for a in m.group(3).split(",")]
        out[m.group(2)] = (ret, args)
    return out


def _norm(ctype):
    """'const dos_hparams *' -> 'const dos_hparams*'."""
    t = " ".join(ctype.replace("*", " * ").split())
    return t.replace(" *", "*")


_SCALARS = {
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64, "double": ctypes.c_double, "float": ctypes.c_float,
    "size_t": ctypes.c_size_t,
    "dos_dtype": ctypes.c_int, "dos_status": ctypes.c_int, "const char*": ctypes.c_char_p,
    "dos_state_format": ctypes.c_int,
    "void*": ctypes.c_void_p, "const void*": ctypes.c_void_p, "float*": ctypes.c_void_p,
    "const float*": ctypes.c_void_p,
    "dos_session*": ctypes.c_void_p, "const dos_session*": ctypes.c_void_p,
    "dos_session**": ctypes.POINTER(ctypes.c_void_p), "void**": ctypes.POINTER(ctypes.c_void_p),
    "void": None,
}


def _expected(ctype):
    if ctype in _SCALARS:
        return _SCALARS[ctype]
    base = ctype.replace("const ", "")
    if base.endswith("*"):
        inner = base[:-1]
        if inner in _native.STRUCTS:
            return ctypes.POINTER(_native.STRUCTS[inner])
        if inner in _SCALARS and _SCALARS[inner] is not None:
            return ctypes.POINTER(_SCALARS[inner])
    raise AssertionError(f"test_native_abi: no ctypes mapping for C type '{ctype}'; add it")


def test_status_enum_matches_header():
    header = {k[len("DOS_"):]: v for k, v in _enum("dos_status").items()}
    assert header == {s.name: int(s) for s in _native.Status}


def test_dtype_enum_matches_header():
    header = {k[len("DOS_DTYPE_"):]: v for k, v in _enum("dos_dtype").items()}
    assert header == {d.name: int(d) for d in _native.DType}


def test_structs_match_header():
    _check_structs(HEADER)


def _check_structs(path):
    structs = _structs(path)
    assert set(structs) == set(_native.STRUCTS), "dos.h structs vs _native.STRUCTS"
    for cname, fields in structs.items():
        mirror = _native.STRUCTS[cname]._fields_
        assert [f for f, _ in mirror] == [f for f, _ in fields], cname
        for (fname, ctype), (_, pytype) in zip(fields, mirror):
            assert pytype is _expected(ctype), f"{cname}.{fname}: {ctype} vs {pytype}"


def test_function_signatures_match_header():
    funcs = _functions()
    assert len(funcs) >= 20  # the parser found the declarations
    assert set(funcs) == set(_native.SIGNATURES), (
        f"in dos.h only: {sorted(set(funcs) - set(_native.SIGNATURES))}; "
        f"in _native only: {sorted(set(_native.SIGNATURES) - set(funcs))}")
    for name, (ret, args) in funcs.items():
        pyret, pyargs = _native.SIGNATURES[name]
        assert pyret is _expected(ret), f"{name} returns {ret}, bound as {pyret}"
        assert len(pyargs) == len(args), f"{name}: {len(args)} arguments in dos.h"
        for i, (ctype, pytype) in enumerate(zip(args, pyargs)):
            assert pytype is _expected(ctype), f"{name} argument {i}: {ctype} vs {pytype}"


def test_every_function_is_exported():
    for name in _native.SIGNATURES:
        assert hasattr(_native.lib, name), name


def test_parser_sees_a_changed_header(tmp_path):
    """The parser itself: a field added to a struct in the header is seen."""
    with open(HEADER) as f:
        text = f.read()
    changed = text.replace("uint64_t subgroup_size;", "uint64_t subgroup_size;\n  int32_t extra;")
    assert changed != text
    path = tmp_path / "dos.h"
    path.write_text(changed)
    with pytest.raises(AssertionError):
        _check_structs(str(path))
