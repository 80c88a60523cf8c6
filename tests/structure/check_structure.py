#!/usr/bin/env python3
"""Structure limits of the repository (issues 13 and 25), run by ctest as `structure`.

  - daemon/ and client/: no C++ source file longer than 600 lines;
  - daemon/ and client/: no C++ function longer than 100 lines (from its
    opening brace to its closing one), found by a brace counter that skips
    comments, string and character literals: a `{` whose enclosing scopes
    are all namespaces, classes or `extern` blocks and whose preceding text
    holds a parameter list opens a function (lambdas and nested blocks count
    toward the function they sit in);
  - client/: no Python module longer than 500 lines and no Python function
    (or method) longer than 60 lines (Python's ast: end_lineno - lineno + 1,
    from the `def` line; a nested function counts in its parent too);
  - nothing under client/ includes a daemon/ header;
  - the top-level folders are exactly the product's layout (TOP_LEVEL):
    code shared by daemon and client lives in proto/, not in a new root
    folder. Hidden folders and build folders (build*/, ignored) are skipped.

Usage: check_structure.py [--only=daemon|client|layout] REPO_ROOT. --only
checks one part alone (e.g. the daemon while the client is being split).
Prints every violation with its file and line and exits 1 if there is any
(2 for an unknown --only).
"""
import ast
import os
import re
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
MAX_PY_MODULE_LINES = 500
MAX_PY_FUNCTION_LINES = 60
PARTS = ("daemon", "client", "layout")
SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
TOP_LEVEL = {"bench", "client", "cmake", "daemon", "deploy", "docs", "proto", "tests"}


def strip_code(text):
    """Text with comments and literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = ")" + m.group(1) + '"'
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            # A digit separator (1'000) is not a character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


SCOPE_RE = re.compile(r"\b(namespace|class|struct|union|enum)\b[^;()]*$|\bextern\s*$")


def functions(code):
    """(start_line, lines, head) of every function body in stripped code."""
    stack = []  # per open brace: (kind, start_line, head)
    found = []
    line = 1
    last = 0  # index after the last ; { }
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c == "{":
            head = code[last:i]
            head_flat = " ".join(head.split())
            if all(k == "scope" for k, _, _ in stack):
                if SCOPE_RE.search(head_flat) or head_flat.endswith("extern \"C\""):
                    kind = "scope"
                elif ")" in head_flat and not head_flat.endswith("="):
                    kind = "function"
                else:
                    kind = "block"  # an initializer or a class-like scope we did not recognise
            else:
                kind = "inner"
            stack.append((kind, line, head_flat))
            last = i + 1
        elif c == "}":
            if stack:
                kind, start, head = stack.pop()
                if kind == "function":
                    found.append((start, line - start + 1, head))
            last = i + 1
        elif c == ";":
            last = i + 1
    return found


def main(root, only=None):
    if only is not None and only not in PARTS:
        print(f"structure: --only={only} is not one of {', '.join(PARTS)}")
        return 2
    problems = []
    if only in (None, "daemon"):
        problems += check_daemon(root)
    if only in (None, "client"):
        problems += check_client(root)
    if only in (None, "layout"):
        problems += check_layout(root)
    for p in problems:
        print(p)
    print(f"structure: {len(problems)} problem(s)")
    return 1 if problems else 0


def source_files(folder, ext):
    """Files under `folder` ending in `ext`, sorted; skips hidden, build and cache folders."""
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "build", "__pycache__"))
                         and not d.endswith(".egg-info"))
        for f in sorted(files):
            if f.endswith(ext):
                yield os.path.join(dirpath, f)


def check_cxx_sizes(root, part):
    """C++ files over MAX_FILE_LINES and functions over MAX_FUNCTION_LINES under `part`/."""
    problems = []
    for path in source_files(os.path.join(root, part), SOURCE_EXT):
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        n_lines = text.count("\n")
        if n_lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {n_lines} lines (limit {MAX_FILE_LINES}): split it by responsibility")
        for start, length, head in functions(strip_code(text)):
            if length > MAX_FUNCTION_LINES:
                name = head[-80:]
                problems.append(f"{rel}:{start}: function of {length} lines (limit "
                                f"{MAX_FUNCTION_LINES}): {name}")
    return problems


def check_python_sizes(root, part):
    """Python modules over MAX_PY_MODULE_LINES and functions over MAX_PY_FUNCTION_LINES."""
    problems = []
    for path in source_files(os.path.join(root, part), (".py",)):
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        n_lines = text.count("\n")
        if n_lines > MAX_PY_MODULE_LINES:
            problems.append(f"{rel}: {n_lines} lines (limit {MAX_PY_MODULE_LINES}): split it into "
                            "parts with narrow interfaces")
        try:
            tree = ast.parse(text, filename=rel)
        except SyntaxError as e:
            problems.append(f"{rel}:{e.lineno}: does not parse: {e.msg}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_PY_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno}: function {node.name} of {length} lines "
                                    f"(limit {MAX_PY_FUNCTION_LINES})")
    return problems


def check_daemon(root):
    return check_cxx_sizes(root, "daemon")


def check_client(root):
    problems = check_cxx_sizes(root, "client") + check_python_sizes(root, "client")
    client = os.path.join(root, "client")
    include_re = re.compile(r'^\s*#\s*include\s*[<"](daemon/[^">]+)[">]', re.M)
    for path in source_files(client, SOURCE_EXT):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        for m in include_re.finditer(text):
            ln = text.count("\n", 0, m.start()) + 1
            problems.append(f"{os.path.relpath(path, root)}:{ln}: includes {m.group(1)}; the "
                            "client may use only shared code, never daemon/ headers")
    return problems


def check_layout(root):
    """Top-level folders other than TOP_LEVEL, and TOP_LEVEL folders missing."""
    present = {d for d in os.listdir(root)
               if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
               and not d.startswith("build")}
    problems = [f"{d}/: a top-level folder outside the layout ({', '.join(sorted(TOP_LEVEL))}); "
                "move it under the part that owns it (shared code: proto/)"
                for d in sorted(present - TOP_LEVEL)]
    problems += [f"{d}/: missing; the layout has it (update TOP_LEVEL in "
                 "tests/structure/check_structure.py and the README if it really went)"
                 for d in sorted(TOP_LEVEL - present)]
    return problems


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--only=")]
    only = next((a[len("--only="):] for a in sys.argv[1:] if a.startswith("--only=")), None)
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.exit(main(root, only))
