"""Every environment variable of the package's own that the code reads is listed in
docs/environment.md, and every one listed there is still read somewhere (no undocumented knobs,
no stale rows)."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "environment.md")
PREFIX = r"(?:ASCEND_MOE_OPS|AMO|EP_TEST|ASC)_[A-Z0-9_]*[A-Z0-9]"
# a quoted name in Python/C++ ("NAME"), a shell use ($NAME, ${NAME}, export NAME=) or CMake's $ENV{NAME}
QUOTED = re.compile(r"[\"'](" + PREFIX + r")[\"']")
SHELL = re.compile(r"(?:\$\{?|\bexport\s+)(" + PREFIX + r")\b")
CMAKE = re.compile(r"\$ENV\{(" + PREFIX + r")\}")
SOURCE_ENDINGS = (".py", ".cpp", ".h", ".sh", ".txt", ".cmake")


def _tracked_sources():
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        out = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs
               if ".git" not in d]
    return [p for p in out if p.endswith(SOURCE_ENDINGS) and p != "tests/test_environment_doc.py"
            and os.path.isfile(os.path.join(ROOT, p))]


def variables_in_code():
    found = {}
    for rel in _tracked_sources():
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        pats = {".sh": (QUOTED, SHELL), ".txt": (CMAKE,), ".cmake": (CMAKE,)}.get(
            os.path.splitext(rel)[1], (QUOTED,))
        for pat in pats:
            for name in pat.findall(text):
                found.setdefault(name, rel)
    return found


def variables_in_doc():
    with open(DOC, encoding="utf-8") as f:
        rows = [ln for ln in f if ln.startswith("| `")]
    return {m.group(1) for ln in rows for m in [re.match(r"\| `([A-Z0-9_]+)`", ln)] if m}


def test_scan_finds_the_known_variables():
    # the scan itself must work, or the two tests below would pass on nothing
    code = variables_in_code()
    for name in ("ASCEND_MOE_OPS_BACKEND", "ASCEND_MOE_OPS_EMU_PIPES", "AMO_GG_AMX",
                 "ASCEND_MOE_OPS_CXX_SANITIZE"):
        assert name in code, name


def test_every_variable_read_is_documented():
    missing = {n: where for n, where in variables_in_code().items() if n not in variables_in_doc()}
    assert not missing, ("environment variables read by the code but not listed in "
                         f"docs/environment.md: {missing}")


def test_every_documented_variable_is_read():
    code = variables_in_code()
    own = re.compile(PREFIX + "$")
    stale = sorted(n for n in variables_in_doc() if own.match(n) and n not in code)
    assert not stale, f"docs/environment.md lists variables no code reads: {stale}"
