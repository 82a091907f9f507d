"""docs/results.md is what benchmarks/report.py writes from benchmarks/results/, and the tables of
docs/simulator-validation.md what benchmarks/sim/validate.py prints from its files: no figure is typed by hand."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_results_page_is_regenerated_from_the_data():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check", "--no-figures"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_validation_pages_tables_are_those_of_the_data():
    results = ROOT / "benchmarks" / "results"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sim" / "validate.py"), "published", "--tables",
         "--out", str(results / "sim_validation-cpu2.jsonl"),
         "--plan-out", str(results / "sim_validation_plan-cpu16.jsonl"),
         "--doc", str(ROOT / "docs" / "simulator-validation.md"), "--check"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def _expansions(token: str) -> list[str]:
    """A file name as the docs write a family of them: ``{a,b}`` and ``{1..4}`` alternatives, ``[graph-]`` an
    optional part."""
    optional = re.search(r"\[([^\[\]]*-[^\[\]]*)\]", token)
    if optional:
        head, tail = token[: optional.start()], token[optional.end() :]
        return _expansions(head + tail) + _expansions(head + optional.group(1) + tail)
    span = re.search(r"\{(\d+)\.\.(\d+)\}", token)
    if span:
        head, tail = token[: span.start()], token[span.end() :]
        return [e for i in range(int(span.group(1)), int(span.group(2)) + 1) for e in _expansions(f"{head}{i}{tail}")]
    choice = re.search(r"\{([^{}]*)\}", token)
    if choice:
        head, tail = token[: choice.start()], token[choice.end() :]
        return [e for alternative in choice.group(1).split(",") for e in _expansions(head + alternative + tail)]
    return [token]


def test_every_results_file_is_named_by_a_doc_or_a_script():
    """A measurement nothing reads or quotes is clutter: each file under benchmarks/results/ is named (whole, or
    by a family pattern) in the docs, the benchmark scripts, the tests or the package."""
    sources = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "dtrain").rglob("*.py")]
    sources += [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".md", ".py", ".sh", ".toml")]
    sources += list((ROOT / "tests").rglob("*.py"))
    text = "\n".join(p.read_text(errors="replace") for p in sources if "results" not in p.relative_to(ROOT).parts)
    names, patterns = set(), set()
    for token in set(re.findall(r"[\w\-.{},*\[\]]+", text)):
        if "-" not in token or len(token) < 6:
            continue
        for name in _expansions(token) if token.count("{") == token.count("}") else [token]:
            stem = name.split("*")[0]
            (patterns if "*" in name and "[" not in name and len(stem) >= 4 else names).add(name.strip(".,"))
    listed = "\n".join(names)
    unnamed = [
        path.name
        for path in sorted((ROOT / "benchmarks" / "results").iterdir())
        if path.is_file()
        and path.stem not in listed
        and not any(fnmatch.fnmatch(path.name, p) or fnmatch.fnmatch(path.stem, p) for p in patterns)
    ]
    assert not unnamed, f"files under benchmarks/results/ that nothing names: {unnamed}"
