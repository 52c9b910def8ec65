"""Every code block in README.md runs, as written, against the demo's tiny model.

The README drifted from the code once (layers 2-3 on a 2-layer model, a three-token
"single" answer, placeholders, undefined names), so this test extracts its fenced blocks and
runs them; a block that stops running fails it. The rules a README block lives by:

- ```` ```python ```` blocks run in order, one namespace per `##` section (a reader may start
  at any section, so each section defines what it uses); ```` ```bash ```` blocks run in
  `bash -euo pipefail`. All run in one scratch directory, in README order, as a reader
  following the README in one directory would (so `tiny-llama`, made by the first section,
  is there for the later ones).
- Every block runs twice in a row, as a reader who pastes it again would: a block that works
  only once (a name registered without `overwrite=True`, a directory made without `-p`, a
  run id captured twice) fails the test on its second run.
- ```` ```text ```` blocks are not code (layouts, printed tables) and are not run. A block in
  any other language, or with none, fails the test: say what it is.
- An HTML comment on the line before a block changes how it runs:
  `<!-- readme-test: cluster -->` — it talks to a running `coxswain up --tiny` cluster: the
  test starts an equivalent one (its own local Ray, free ports, a scratch `COXSWAIN_HOME`,
  its own Redis), exports the admin key as `KEY`, and points `localhost:8000` and
  `localhost:50051` at that cluster's HTTP and gRPC ports;
  `<!-- readme-test: script -->` — a Python block run as its own `python file.py` (it spawns
  processes that must import its functions from `__main__`);
  `<!-- readme-test: skip (why) -->` — not run here (it needs a GPU or minutes of training,
  or starts what the test starts itself); the reason is required and the skips are counted.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.local_ray import start_local_ray

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*readme-test:\s*(\w+)\s*(?:\((.+)\))?\s*-->\s*$")
MODES = {"run", "cluster", "script", "skip"}
RUNNABLE = {"python", "bash"}
BLOCK_TIMEOUT_S = 300
RUNS = ("first run", "second run")  # each block twice in a row (see the docstring)
ADMIN_KEY, READ_KEY = "cx-admin-" + "a" * 32, "cx-read-" + "r" * 32


@dataclass
class Block:
    section: str
    lang: str
    code: str
    line: int  # the README line of the block's first code line
    mode: str = "run"
    reason: str = ""

    def where(self) -> str:
        return f"README.md:{self.line} ({self.section})"


def parse(text: str) -> list[Block]:
    """The fenced blocks of `text`, each with its section and marker; malformed markers fail."""
    blocks: list[Block] = []
    section, mark, fence, body, start = "(top)", None, None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            if line.strip() == "```":
                mode, reason = mark or ("run", "")
                blocks.append(Block(section, fence, "\n".join(body) + "\n", start, mode, reason))
                fence, mark, body = None, None, []
            else:
                body.append(line)
            continue
        if m := FENCE.match(line):
            fence, start = m.group(1), n + 1
            continue
        if mark is not None and line.strip():
            raise AssertionError(f"README.md:{n}: a readme-test marker not followed by a block")
        if line.startswith("<!--") and "readme-test" in line:
            m = MARK.match(line)
            assert m, f"README.md:{n}: malformed marker {line!r}"
            assert m.group(1) in MODES, f"README.md:{n}: unknown readme-test mode {m.group(1)!r}"
            mark = (m.group(1), (m.group(2) or "").strip())
        elif line.startswith("## "):
            section = line[3:].strip()
    assert fence is None, "README.md ends inside a code block"
    return blocks


BLOCKS = parse(README.read_text())
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if b.lang in RUNNABLE))


def test_every_block_is_runnable_or_marked():
    """No block the test would silently pass over: each is python/bash (run), text, or a
    skip with its reason; and the README really has examples of each kind we run."""
    unknown = [f"{b.where()}: ```{b.lang}" for b in BLOCKS if b.lang not in RUNNABLE | {"text"}]
    assert not unknown, f"blocks the test cannot run (tag them python, bash or text): {unknown}"
    for b in BLOCKS:
        assert b.mode != "skip" or b.reason, f"{b.where()}: a skip needs its reason"
        assert b.lang != "text" or b.mode == "run", f"{b.where()}: a text block takes no marker"
        assert b.mode != "script" or b.lang == "python", f"{b.where()}: script is for python"
    runnable = [b for b in BLOCKS if b.lang in RUNNABLE]
    skipped = [b for b in runnable if b.mode == "skip"]
    assert len(runnable) >= 15 and len(skipped) <= 6, (len(runnable), len(skipped))
    for b in skipped:  # counted, and shown with -rA
        print(f"skipped {b.where()}: {b.reason}")


# -- running --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The reader's directory, shared by every section in README order."""
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The environment blocks run in: this interpreter's scripts on PATH, a scratch home for
    everything Coxswain writes, and no Ray address (the tests' own Ray only)."""
    home = tmp_path_factory.mktemp("coxswain-home")
    saved = {k: os.environ.get(k) for k in ("COXSWAIN_HOME",)}
    os.environ["COXSWAIN_HOME"] = str(home)
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(README.parent), out.get("PYTHONPATH")]))
    out.pop("RAY_ADDRESS", None)
    yield out
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Cluster:
    """`coxswain up --tiny`'s cluster, started on first use: a local Ray of its own, the
    Serve application (gateway, one engine replica, patch store, controller), a Redis."""

    def __init__(self, model: Path, home: Path) -> None:
        self.model, self.home = model, home
        self.info: dict[str, str] | None = None
        self.redis: Any = None
        self.ray_started = False

    def start(self) -> dict[str, str]:
        if self.info is not None:
            return self.info
        from ray import serve

        from services.common.net import free_port
        from services.controller.redis_server import RedisServer
        from services.gateway.serve_app import build_app

        keys = self.home / "api_keys"
        keys.write_text(f"admin:admin:{ADMIN_KEY}\nreader:read:{READ_KEY}\n")
        keys.chmod(0o600)
        self.redis = RedisServer(password=secrets.token_hex(16)).start()  # as `up` starts it
        self.ray_started = True
        start_local_ray(num_cpus=4, namespace="coxswain")
        http_port, grpc_port = free_port(), free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {
            "model": str(self.model),
            "api_keys_file": str(keys),
            "redis_url": self.redis.url,
            "grpc_port": grpc_port,
            "controller_grpc_port": free_port(),
            "patch_store_budget_gb": 0.0625,
            "device": "cpu",
            "dtype": "float32",
            "engine_replicas": 1,
        }
        serve.run(build_app(args), name="coxswain", route_prefix="/")
        self.info = {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}
        return self.info

    def stop(self) -> None:
        if self.ray_started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        if self.redis is not None:
            self.redis.close()


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, env) -> Iterator[Cluster]:
    c = Cluster(tiny_checkpoint("llama"), Path(env["COXSWAIN_HOME"]))
    yield c
    c.stop()


def _for_cluster(code: str, info: dict[str, str]) -> str:
    return code.replace("localhost:8000", info["http"]).replace("localhost:50051", info["grpc"])


def _run_bash(block: Block, run: str, code: str, workdir: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.where()}, {run}: exited {done.returncode}:\n{code}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )


def _run_script(block: Block, run: str, code: str, workdir: Path, env: dict[str, str]) -> None:
    path = workdir / f"readme_block_{block.line}.py"
    path.write_text(code)
    done = subprocess.run(
        [sys.executable, path.name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.where()}, {run}: exited {done.returncode}:\n{done.stderr[-4000:]}"
    )


def _run_python(block: Block, code: str, namespace: dict[str, Any]) -> None:
    # Leading newlines: a traceback names the README's own line numbers.
    compiled = compile("\n" * (block.line - 1) + code, str(README), "exec")
    exec(compiled, namespace)  # running the README is the point


class Reader:
    """A reader following the README in one directory: sections run in README order, each
    once, and each block of a section twice in a row; asking for a section first runs the
    ones before it (so `-k` works)."""

    def __init__(self, workdir: Path, env: dict[str, str], cluster: Cluster) -> None:
        self.workdir, self.env, self.cluster = workdir, env, cluster
        self.ran: dict[str, BaseException | None] = {}

    def section(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        for earlier in SECTIONS[: SECTIONS.index(name)]:
            if earlier not in self.ran:
                self._run(earlier, monkeypatch)
        self._run(name, monkeypatch)

    def _run(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(self.workdir)
        namespace: dict[str, Any] = {"__name__": "__readme__"}
        self.ran[name] = None
        for block in (b for b in BLOCKS if b.section == name and b.lang in RUNNABLE):
            if block.mode == "skip":
                continue
            code, env = block.code, self.env
            if block.mode == "cluster":
                info = self.cluster.start()
                code = _for_cluster(code, info)
                env = {**env, "KEY": ADMIN_KEY}
                monkeypatch.setenv("KEY", ADMIN_KEY)
            for run in RUNS:
                if block.lang == "bash":
                    _run_bash(block, run, code, self.workdir, env)
                elif block.mode == "script":
                    _run_script(block, run, code, self.workdir, env)
                else:
                    try:
                        _run_python(block, code, namespace)
                    except Exception as exc:
                        raise AssertionError(
                            f"{block.where()}, {run}: raised {type(exc).__name__}: {exc}\n"
                            + textwrap.indent(code, "    ")
                        ) from exc


@pytest.fixture(scope="module")
def reader(workdir, env, cluster) -> Reader:
    return Reader(workdir, env, cluster)


@pytest.mark.slow
@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section, reader, monkeypatch):
    reader.section(section, monkeypatch)
