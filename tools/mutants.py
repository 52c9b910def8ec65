"""Mutation check: do the tests notice a one-operator change in the code they cover?

Each mutant changes one operator in one file (`max` ↔ `min`, `<` ↔ `<=`, `==` ↔ `!=`, `and`
↔ `or`, one factor of a product dropped, a `+ 1` or `- 1` dropped, a `not` dropped). The
script writes it, runs that file's fast test selection, and puts the file back byte for byte
(and its mtime) in a `finally`. A mutant the tests fail on is killed; one they pass survives:
a gap in the tests, or a change that makes no difference (an equivalent mutant), which only
reading it tells apart.

It edits source files, so it refuses to run anywhere but a linked git worktree: never the
checkout other people run tests in. `services` is installed in editable mode pointing at the
main checkout, so the tests run with PYTHONPATH set to the worktree (and the script checks
that they import it from there):

    git worktree add /tmp/mutwt HEAD
    python tools/mutants.py --root /tmp/mutwt                 # every target file
    python tools/mutants.py --root /tmp/mutwt --file services/engine/sampler.py --sample 10
    python tools/mutants.py --root /tmp/mutwt --list          # the mutants, nothing run
    git worktree remove --force /tmp/mutwt
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Each target file and the fast tests that claim to cover it (unit tests first: with -x a
# killed mutant stops at its first failure).
TARGETS: dict[str, list[str]] = {
    "services/engine/sampler.py": ["tests/unit/engine/test_sampler.py"],
    "services/engine/interventions/manager.py": [
        "tests/unit/engine/interventions",
        "tests/integration/test_steering_control.py",
    ],
    "services/common/auth.py": ["tests/unit/common/test_api_keys.py"],
    "services/gateway/grpc_convert.py": [
        "tests/unit/gateway/test_sampling_params_conversions.py",
        "tests/unit/gateway/test_prompt_and_sweep_conversions.py",
        "tests/unit/gateway/test_one_validation.py",
    ],
}

COMPARE_SWAPS: dict[type[ast.cmpop], str] = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
}
MIN_MAX = {"min": "max", "max": "min"}


@dataclass(frozen=True)
class Mutant:
    """Replace bytes `[start, end)` of `path` with `replacement`."""

    path: str
    line: int
    start: int
    end: int
    replacement: bytes
    what: str  # the operator change, e.g. "max -> min"

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement + source[self.end :]


def mutants_of(path: str, source: bytes) -> list[Mutant]:
    """Every single-operator mutant of one file, in source order."""
    tree = ast.parse(source)
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def span(node: ast.AST) -> tuple[int, int]:
        # ast offsets are UTF-8 byte columns, so the file is sliced as bytes
        start = line_starts[node.lineno - 1] + node.col_offset
        return start, line_starts[node.end_lineno - 1] + node.end_col_offset

    def text(node: ast.AST) -> str:
        start, end = span(node)
        return source[start:end].decode()

    def mutant(node: ast.AST, replacement: str, what: str) -> Mutant:
        start, end = span(node)
        return Mutant(path, node.lineno, start, end, replacement.encode(), what)

    found: list[Mutant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in MIN_MAX:
                other = MIN_MAX[node.func.id]
                found.append(mutant(node.func, other, f"{node.func.id} -> {other}"))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            new_op = COMPARE_SWAPS.get(type(node.ops[0]))
            if new_op is not None:
                old_op = source[span(node.left)[1] : span(node.comparators[0])[0]].decode()
                replaced = f"{text(node.left)} {new_op} {text(node.comparators[0])}"
                found.append(mutant(node, replaced, f"{old_op.strip()} -> {new_op}"))
        elif isinstance(node, ast.BoolOp):
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            replaced = f" {new} ".join(f"({text(v)})" for v in node.values)
            found.append(mutant(node, replaced, f"{old} -> {new}"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            start, end = span(node)  # operands' brackets are inside the product's span
            left_end = span(node.left)[1]
            star = left_end + source[left_end : span(node.right)[0]].index(b"*")
            times_right = source[star:end].decode()
            left_times = source[start : star + 1].decode()
            found.append(mutant(node, f"({text(node.left)})", f"drop '{times_right}'"))
            found.append(mutant(node, f"({text(node.right)})", f"drop '{left_times}'"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            right = node.right
            if isinstance(right, ast.Constant) and right.value == 1:
                sign = "+" if isinstance(node.op, ast.Add) else "-"
                found.append(mutant(node, f"({text(node.left)})", f"drop '{sign} 1'"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            found.append(mutant(node, f"({text(node.operand)})", "drop 'not'"))
    return sorted(found, key=lambda m: m.start)


def spread(mutants: list[Mutant], n: int | None) -> list[Mutant]:
    """`n` mutants spread evenly over the file (all of them when n is None or larger)."""
    if n is None or n >= len(mutants):
        return mutants
    return [mutants[i * len(mutants) // n] for i in range(n)]


def run_tests(root: Path, selection: list[str], timeout: float) -> str:
    """'passed', 'failed' or 'timeout' for the selection run against the code under `root`."""
    # No bytecode written: a same-size mutant written within one second of another could
    # otherwise be served from the other's cached .pyc.
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection]
    try:
        done = subprocess.run(
            cmd, cwd=root, env=env, timeout=timeout, capture_output=True, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return "passed" if done.returncode == 0 else "failed"


def check_root(root: Path) -> None:
    """Refuse anything but a linked worktree whose own `services` the tests will import."""
    git = ["git", "-C", str(root), "rev-parse", "--absolute-git-dir", "--git-common-dir"]
    out = subprocess.run(git, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{root} is not a git worktree: make one with `git worktree add`")
    git_dir, common = out.stdout.split()
    if Path(git_dir).resolve() == (root / common).resolve():
        sys.exit(f"{root} is a main checkout: mutate a linked worktree (`git worktree add`)")
    probe = [sys.executable, "-c", "import services; print(services.__file__)"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    where = subprocess.run(probe, cwd=root, env=env, capture_output=True, text=True, check=True)
    if not Path(where.stdout.strip()).resolve().is_relative_to(root):
        sys.exit(f"the tests would import services from {where.stdout.strip()}, not {root}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="a linked git worktree")
    parser.add_argument("--file", action="append", choices=sorted(TARGETS), help="repeatable")
    parser.add_argument("--sample", type=int, help="at most this many mutants per file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test run")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    args = parser.parse_args()
    root = args.root.resolve()
    check_root(root)
    # A plain `kill` unwinds like Ctrl-C, through the `finally` that restores the file.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))

    survivors: list[tuple[Mutant, str]] = []
    killed = total = 0
    for path in args.file or TARGETS:
        file = root / path
        original = file.read_bytes()
        stat = file.stat()
        mutants = spread(mutants_of(path, original), args.sample)
        print(f"== {path}: {len(mutants)} mutants, tests: {' '.join(TARGETS[path])}")
        if args.list:
            for m in mutants:
                print(f"   {path}:{m.line}  {m.what}")
            continue
        if run_tests(root, TARGETS[path], args.timeout) != "passed":
            sys.exit(f"the tests of {path} fail without any mutant: fix them first")
        for m in mutants:
            mutated = m.apply(original)
            line = mutated.splitlines()[m.line - 1].decode().strip()
            try:
                compile(mutated, str(file), "exec")
            except SyntaxError:
                print(f"   invalid   {path}:{m.line}  {m.what}")
                continue
            try:
                file.write_bytes(mutated)
                outcome = run_tests(root, TARGETS[path], args.timeout)
            finally:
                file.write_bytes(original)
                os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            total += 1
            if outcome == "passed":
                survivors.append((m, line))
                print(f"   SURVIVED  {path}:{m.line}  {m.what}    {line}", flush=True)
            else:
                killed += 1
                print(f"   killed    {path}:{m.line}  {m.what} ({outcome})", flush=True)
        assert file.read_bytes() == original, f"{path} was not restored"
    if total:
        print(f"\nscore: {killed}/{total} killed ({100 * killed / total:.0f}%)")
        for m, line in survivors:
            print(f"survived: {m.path}:{m.line}  {m.what}    {line}")


if __name__ == "__main__":
    main()
