#!/usr/bin/env python3
"""Prints why ctest skipped tests, from its JUnit file (ctest --output-junit).

ctest shows a skipped test as "***Skipped" without the reason; this groups
the skipped tests by the reason they printed (GTEST_SKIP()'s message, or a
script's "SKIP: ..." line before exit 77), plus the cases pytest skipped
inside a test that passed (its -rs summary), so that it reaches the console:

    python3 tests/skipped_report.py build/ctest-junit.xml
"""
import collections
import re
import sys
import xml.etree.ElementTree as ET


def reason(out: str) -> str:
    lines = out.splitlines()
    for i, line in enumerate(lines):
        # gtest: "file.cc:69: Skipped" then the message up to "[  SKIPPED ]".
        if re.search(r":\d+: Skipped$", line):
            msg = []
            for rest in lines[i + 1:]:
                if rest.startswith("[  SKIPPED ]"):
                    break
                msg.append(rest.strip())
            return " ".join(m for m in msg if m) or "GTEST_SKIP() without a message"
    for line in lines:
        if line.strip().startswith(("SKIP:", "SKIPPED:", "skip:")) or " SKIPPED " in line:
            return line.strip()
    tail = [l.strip() for l in lines if l.strip()]
    return tail[-1] if tail else "no reason printed"


def main(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"skipped_report: cannot read {path}: {e}")
        return 0
    groups = collections.OrderedDict()
    for case in root.iter("testcase"):
        out = case.findtext("system-out") or ""
        if case.find("skipped") is None:
            # A test that ran but skipped some of its cases (pytest -rs):
            # "SKIPPED [2] test_cuda.py:40: no CUDA device".
            for m in re.finditer(r"^SKIPPED \[(\d+)\] ([^:\n]+):\d+: (.*)$", out, re.M):
                names = groups.setdefault(f"{m.group(3)} (pytest)", [])
                names.extend([f"{case.get('name', '?')}: {m.group(2)}"] * int(m.group(1)))
            continue
        groups.setdefault(reason(out), []).append(case.get("name", "?"))
    if not groups:
        return 0
    total = sum(len(v) for v in groups.values())
    print(f"== {total} tests skipped, by reason:")
    for why, names in groups.items():
        unique = list(dict.fromkeys(names))
        shown = ", ".join(unique[:3]) + (f", ... ({len(unique) - 3} more)" if len(unique) > 3 else "")
        print(f"  {len(names):4d} x {why}\n         {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/ctest-junit.xml"))
