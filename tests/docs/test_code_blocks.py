"""Every fenced code block of README.md and docs/*.md is run or checked here, so none can rot.

The convention: the info string after the opening fence (```` ```python torchrun twice ````)
says what a block is, as words. A block whose info string is not one of these fails
:func:`test_every_block_has_a_known_kind`.

Each page is one test. Its blocks run in order, in one fresh temporary folder of the page's
own (the current directory of every process), so a block may read what an earlier block of
the same page wrote. Every process gets ``PJRT_DEVICE=CPU`` (the real XLA CPU device),
``XLA_CKPT_BUCKET=my-bucket`` and the session's GCS emulator (``STORAGE_EMULATOR_HOST``), on
which the buckets ``bucket`` and ``my-bucket`` exist and are emptied after each page, so a
``gs://bucket/...`` URI in a block is a real GCS round trip.

Run for real:

* ``python``: a fresh ``python`` process runs the block; it must exit 0. Blocks assert what
  they claim with ``assert`` where a reader can see it.
* ``python torchrun``: the block is a ``train.py`` for ``torchrun --nproc-per-node 2``: it runs
  on 2 real gloo ranks (torchrun's variables, loopback only, a hard timeout), 2 fresh processes
  for each run, forked from one clean :mod:`xla_ckpt.testing.launcher` worker that has
  imported torch and the library (``crash_harness.run_jobs``), so no run waits for
  interpreters to start; every rank must finish.
* ``twice`` (with either): the block runs again in the same folder, as a restarted job. The
  first run must log the manager's fresh start ("training starts from scratch") and the second
  must not: it resumed from what the first committed.
* ``needs:NAME``: before the block, the fixture ``NAME`` of :data:`NEEDS` writes the input a
  reader brings (a fairseq ``.pt`` file or run folder, an HF model folder) into the page folder.
* ``sh``: every line is an ``xla-ckpt`` command (the project's own console script), run in
  the page folder; each must exit 0. Anything else than ``xla-ckpt`` is refused here.
* ``yaml``: loaded through ``xla_ckpt.config.load_config``; every key it sets must hold that
  value in the loaded config (``${VAR}`` expanded as the loader does). ``file=NAME`` also
  writes it to ``NAME`` in the page folder for the next blocks.

Checked, not run (they need a cloud, a TPU, a GPU or Docker):

* ``bash`` (README only, its first block): the two set-up commands. Command 2 is the line
  ``.ci/run`` ends with; command 1's ``xla-ckpt demo`` parses with the real CLI parser (the
  demo itself runs in ``tests/demo``).
* ``bash tpu-vm``: the ``pip install`` names this package and its ``tpu`` extra; the
  ``xla-ckpt train`` arguments parse with the real parser; the config it names loads, with
  ``dist.backend: xla`` and the exported bucket in ``save_dir``.
* ``bash gke``: the image is built from the repository's ``Dockerfile`` (whose entry point is
  ``xla-ckpt``) with the package's version as tag and pushed under the same name; the JobSet,
  with the ``sed`` substitutions applied, parses, runs that image with that bucket, and its
  ``args`` parse and name a config that the ``Dockerfile`` copies and that loads.
* ``bash cuda``: the module after ``torchrun -m`` exists, its arguments parse, the config loads
  with ``dist.backend: nccl``.

Samples (``text NAME``): output or layout shown to a reader, compared with the real thing.

* ``text ls-output``: the real ``xla-ckpt ls`` of the page's ``run`` folder prints the same
  header and the same name, epoch, step, loss, size and pointers on each row (the time column
  and the folder's absolute path differ).
* ``text demo-output``: every column name of the sample's tables is a string literal of the
  demo's code (``xla_ckpt/demo``), so a renamed column fails.
* ``text layout``: each file the sample shows matches a file of a real manager save (manifest,
  the state and rank data files, the pointers); the sharded ``chunks`` file name is the data file
  name rule applied to the chunk item prefix of ``xla_ckpt.format.chunks``.

Pages with a ``torchrun`` block are marked ``slow`` (multi-process); they run in CI all the same.
"""

from __future__ import annotations

import argparse
import ast
import functools
import http.client
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import quote, urlparse

import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests.reliability import crash_harness
from xla_ckpt.cli.main import build_parser
from xla_ckpt.config import load_config
from xla_ckpt.format import STATE_ITEM, rank_item
from xla_ckpt.format.chunks import CHUNK_ITEM_PREFIX
from xla_ckpt.testing.launcher import WorkerPool

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BUCKETS = ("bucket", "my-bucket")
FRESH_START = "training starts from scratch"
README_MAX_BYTES = 12288
RUN_TIMEOUT_S = 180

FENCE = re.compile(r"^```(.*)$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    words: set[str] = field(default_factory=set)
    opts: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, with their info strings split into words and options."""
    out: list[Block] = []
    cur: Block | None = None
    lines: list[str] = []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and cur is None:
            lang, *rest = (m.group(1).split() or [""])
            cur = Block(page, i, lang)
            for w in rest:
                k, sep, v = w.partition(":" if w.startswith("needs:") else "=")
                if sep:
                    cur.opts[k] = v
                else:
                    cur.words.add(w)
            lines = []
        elif m and cur is not None:
            assert not m.group(1), f"{page}:{i}: a fence opens inside the block of line {cur.line}"
            cur.text = "\n".join(lines) + "\n"
            out.append(cur)
            cur = None
        elif cur is not None:
            lines.append(line)
    assert cur is None, f"{page}:{cur.line if cur else 0}: block never closed"
    return out


def kind_of(b: Block) -> str:
    """The convention's name for a block (module docstring), or a reason it has none."""
    words = frozenset(b.words)
    if b.lang == "python" and words <= {"torchrun", "twice"} and set(b.opts) <= {"needs"}:
        return "python"
    if b.lang == "sh" and not words and set(b.opts) <= {"needs"}:
        return "sh"
    if b.lang == "yaml" and not words and set(b.opts) <= {"file"}:
        return "yaml"
    if b.lang == "bash" and not b.opts and len(words) <= 1:
        (name,) = words or {"readme-commands"}
        if name in CHECKERS:
            return name
    if b.lang == "text" and not b.opts and len(words) == 1:
        (name,) = words
        if name in SAMPLES:
            return name
    return f"unknown kind: ```{b.lang} {' '.join(sorted(words))} {b.opts or ''}"


# ---- environment of a page --------------------------------------------------------------------
def _venv_bin() -> Path:
    return Path(sys.executable).parent


def _emulator_call(host: str, method: str, path: str, ok: tuple[int, ...] = (200, 204)) -> Any:
    u = urlparse(host)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=30)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status in ok, f"emulator {method} {path}: HTTP {resp.status} {body[:200]!r}"
        return json.loads(body) if body else None
    finally:
        conn.close()


def _empty_buckets(host: str) -> None:
    for b in BUCKETS:
        token = None
        while True:
            q = f"/storage/v1/b/{b}/o" + (f"?pageToken={quote(token, safe='')}" if token else "")
            doc = _emulator_call(host, "GET", q) or {}
            for o in doc.get("items", []):
                _emulator_call(host, "DELETE", f"/storage/v1/b/{b}/o/{quote(o['name'], safe='')}",
                               ok=(200, 204, 404))
            token = doc.get("nextPageToken")
            if not token:
                break


@pytest.fixture
def page_env(gcs_emulator: Any) -> Iterator[dict[str, str]]:
    """Environment of every process of one page: XLA on CPU, the emulator, the bucket variable."""
    for b in BUCKETS:
        gcs_emulator.create_bucket(b)
    env = {**os.environ, **gcs_emulator.env(), "PJRT_DEVICE": "CPU",
           "XLA_CKPT_BUCKET": "my-bucket",
           "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    yield env
    _empty_buckets(gcs_emulator.host)


@pytest.fixture(scope="module")
def torchrun_zygote() -> Iterator[Callable[[], WorkerPool]]:
    """The clean worker every ``python torchrun`` run is forked from, started on first use."""
    made: list[WorkerPool] = []

    def get() -> WorkerPool:
        if not made:
            made.append(WorkerPool(1, xla=False))
            (ready,) = made[0].run(preload_torchrun)
            ready.unwrap()
        return made[0]

    yield get
    for p in made:
        p.close()


# ---- running blocks ---------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, env: dict[str, str], where: str) -> str:
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{where}: {cmd[:3]} ran over {RUN_TIMEOUT_S} s") from e
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{where}: exit {p.returncode}\n{out[-4000:]}"
    return out


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_block_on_rank(script: str, cwd: str) -> str:
    """What each rank of a ``python torchrun`` block runs (in a launcher worker): the script."""
    os.chdir(cwd)
    grab = _Collect()
    logging.getLogger().addHandler(grab)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        logging.getLogger().removeHandler(grab)
    return "\n".join(grab.lines)


def torchrun_rank(script: str, cwd: str, env: dict[str, str], rank: int) -> dict:
    """One rank of a ``python torchrun`` block's job (forked, torchrun's variables set):
    the block's environment, then the script; its log lines."""
    os.environ.update(env)
    return {"log": run_block_on_rank(script, cwd)}


def preload_torchrun() -> None:
    """In the zygote: what the ``torchrun`` blocks import (FSDP2 and DTensor pull in
    ``torch._dynamo``, seconds), so that no forked rank imports it again."""
    import torch._dynamo
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.device_mesh
    import torch.distributed.fsdp  # noqa: F401 - imported to warm the forks

    import xla_ckpt.manager
    import xla_ckpt.restore
    import xla_ckpt.storage.gcs
    import xla_ckpt.trainer  # noqa: F401 - imported to warm the forks


def run_python(b: Block, cwd: Path, scripts: Path, env: dict[str, str],
               zygote: Callable[[], WorkerPool]) -> None:
    script = scripts / f"block_{b.line}.py"
    script.write_text(b.text)
    runs = 2 if "twice" in b.words else 1
    outs = []
    for n in range(runs):
        where = f"{b.where} (run {n + 1} of {runs})"
        if "torchrun" in b.words:
            launch_env = {k: env[k] for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT",
                                              "XLA_CKPT_BUCKET", "PJRT_DEVICE")}
            body = functools.partial(torchrun_rank, str(script), str(cwd), launch_env)
            (res,) = zygote().run(crash_harness.run_jobs, [(2, body)], RUN_TIMEOUT_S,
                                  timeout_s=RUN_TIMEOUT_S + 60)
            (ranks,) = res.unwrap()
            for r in ranks:
                assert not r["hang"] and r["exitcode"] == 0 and "log" in (r["value"] or {}), \
                    f"{where}: rank {r['rank']}: {r}"
            outs.append("\n".join(r["value"]["log"] for r in ranks))
        else:
            outs.append(_run([sys.executable, str(script)], cwd, env, where))
    if runs == 2:
        assert FRESH_START in outs[0], f"{b.where}: the first run did not start fresh:\n{outs[0]}"
        assert FRESH_START not in outs[1], f"{b.where}: the second run did not resume:\n{outs[1]}"


SH_RUNNER = """
import shlex, sys
from xla_ckpt.cli.main import main
for line in sys.argv[1:]:
    print("$", line, flush=True)
    rc = main(shlex.split(line, comments=True)[1:])
    if rc:
        sys.exit(f"exit {rc}: {line}")
"""


def run_sh(b: Block, cwd: Path, env: dict[str, str]) -> None:
    """Each line through ``xla_ckpt.cli.main.main``, the function the ``xla-ckpt`` script calls
    (one interpreter per block, not per line: the same code path without the start-up each)."""
    lines = [ln for ln in b.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for line in lines:
        assert shlex.split(line, comments=True)[0] == "xla-ckpt", \
            f"{b.where}: sh runs xla-ckpt only: {line!r}"
    _run([sys.executable, "-c", SH_RUNNER, *lines], cwd, env, b.where)


def _expand(value: Any, env: dict[str, str]) -> Any:
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1], m[2] or ""), value)


def check_yaml(b: Block, cwd: Path, env: dict[str, str]) -> None:

    path = cwd / b.opts.get("file", f"block_{b.line}.yaml")
    path.write_text(b.text)
    cfg = load_config(path, environ=env)
    data = yaml.safe_load(b.text)
    assert isinstance(data, dict) and data, f"{b.where}: an empty YAML block"
    for section, keys in data.items():
        for key, value in keys.items():
            got = getattr(getattr(cfg, section), key)
            assert got == _expand(value, env), f"{b.where}: {section}.{key} loads as {got!r}"
    if "file" not in b.opts:
        path.unlink()


# ---- fixtures a block may need (``needs:NAME``) ------------------------------------------------
def _fairseq_pt(path: Path, num_updates: int, epoch: int, loss: float) -> None:
    """A fairseq Trainer checkpoint (the ``args`` era) of a small MLP with FairseqAdam state."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    optim = {"state": {i: {"step": num_updates,
                           "exp_avg": torch.randn(p.shape, generator=g) * 1e-2,
                           "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-4}
                       for i, p in enumerate(params)},
             "param_groups": [{"lr": 2e-4, "betas": (0.9, 0.98), "eps": 1e-8,
                               "weight_decay": 0.01, "amsgrad": False, "adaptive_adam": False,
                               "params": list(range(len(params)))}]}
    args = argparse.Namespace(arch="tiny", task="translation", optimizer="adam", lr=[2e-4],
                              lr_scheduler="inverse_sqrt", fp16=False,
                              criterion="label_smoothed_cross_entropy")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "cfg": None, "model": model.state_dict(), "criterion": None,
                "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                                       "optimizer_name": "FairseqAdam",
                                       "lr_scheduler_state": {"best": loss},
                                       "num_updates": num_updates}],
                "task_state": {},
                "extra_state": {"metrics": {}, "previous_training_time": 12.5, "val_loss": loss,
                                "train_iterator": {"epoch": epoch, "iterations_in_epoch": 3,
                                                   "version": 2}},
                "last_optimizer_state": optim}, path)


def need_fairseq_checkpoint(cwd: Path) -> None:
    _fairseq_pt(cwd / "checkpoints" / "checkpoint_last.pt", 7, 2, 2.5)


def need_fairseq_run(cwd: Path) -> None:
    run = cwd / "fairseq-run"
    _fairseq_pt(run / "checkpoint1.pt", 2, 1, 1.0)
    _fairseq_pt(run / "checkpoint_2_500.pt", 500, 2, 1.5)
    shutil.copy(run / "checkpoint_2_500.pt", run / "checkpoint_last.pt")  # fairseq copies them
    shutil.copy(run / "checkpoint1.pt", run / "checkpoint_best.pt")


def need_hf_model(cwd: Path) -> None:
    """``gpt2/``: a small ``model.safetensors`` (a bfloat16 tensor among them) and its config."""

    d = cwd / "gpt2"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"wte.weight": torch.randn(50, 8, generator=g),
               "h.0.mlp.c_fc.weight": torch.randn(8, 32, generator=g),
               "ln_f.weight": torch.ones(8, dtype=torch.bfloat16)},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1,
                                               "vocab_size": 50}))


NEEDS: dict[str, Callable[[Path], None]] = {
    "fairseq-checkpoint": need_fairseq_checkpoint,
    "fairseq-run": need_fairseq_run,
    "hf-model": need_hf_model,
}


# ---- blocks checked, not run ----------------------------------------------------------------
def _cli_args(argv: list[str]) -> argparse.Namespace:

    return build_parser().parse_args(argv)


def _config(path: Path, env: dict[str, str]) -> Any:

    assert path.is_file(), f"{path} is not in the repository"
    return load_config(path, environ=env)


def _commands(text: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, split like a shell (comments dropped)."""
    return [shlex.split(line, comments=True) for line in _commands_raw(text)]


def _subst(word: str, env: dict[str, str]) -> str:
    """``$NAME`` replaced from ``env`` as a shell would (names it lacks stay as they are)."""
    return re.sub(r"\$(\w+)", lambda m: env.get(m[1], m[0]), word)


def _exports(words: list[str], env: dict[str, str]) -> None:
    """Apply ``export A=x B=y`` to ``env`` (each value expanded from what ``env`` holds)."""
    assert words[0] == "export", words
    for w in words[1:]:
        k, _, v = w.partition("=")
        env[k] = _subst(v, env)


def check_readme_commands(b: Block, _env: dict[str, str]) -> None:
    assert b.page.name == "README.md" and b.line == blocks_of(b.page)[0].line, \
        f"{b.where}: a plain ```bash block is README's two commands only"
    lines = [ln.split("#", 1)[0].rstrip() for ln in b.text.splitlines()]
    assert len(lines) == 2, f"{b.where}: two commands, not {len(lines)}"
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip()]
    assert lines[1] == ci[-1], f"{b.where}: command 2 {lines[1]!r} is not .ci/run's {ci[-1]!r}"
    setup, _, demo = lines[0].partition(" && ")
    assert setup == "bash scripts/setup.sh" and (ROOT / "scripts" / "setup.sh").is_file()
    assert demo.split()[0] == ".venv/bin/xla-ckpt"
    assert _cli_args(demo.split()[1:]).command == "demo"


def check_tpu_vm(b: Block, env: dict[str, str]) -> None:
    meta = importlib.metadata.metadata("xla-ckpt")
    env = dict(env)
    ran_train = False
    for words in _commands(b.text):
        if words[0] == "export":
            _exports(words, env)
            continue
        assert words[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], words
        assert "--worker=all" in words, f"{b.where}: every worker runs it"
        inner = [_subst(w, env) for w in shlex.split(words[words.index("--command") + 1])]
        if inner[:2] == ["pip", "install"]:
            name, _, rest = inner[2].partition("[")
            assert name == meta["Name"], inner[2]
            assert rest.split("]")[0] in (meta.get_all("Provides-Extra") or []), inner[2]
            continue
        while "=" in inner[0]:
            k, _, v = inner.pop(0).partition("=")
            env[k] = v
        assert env.get("PJRT_DEVICE") == "TPU"
        assert inner[0] == "xla-ckpt", inner
        args = _cli_args(inner[1:])
        cfg = _config(ROOT / args.config, env)
        assert args.command == "train" and args.device == "xla"
        assert cfg.dist.backend == "xla"
        assert cfg.checkpoint.save_dir.startswith(f"gs://{env['XLA_CKPT_BUCKET']}/")
        ran_train = True
    assert ran_train, f"{b.where}: no xla-ckpt train command"


def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [(ln.strip().partition(" ")[0], ln.strip().partition(" ")[2].strip())
            for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _shell_words(line: str) -> list[str]:
    """``line`` split like a shell, with ``|`` and ``&&`` as words of their own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars="|&")
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def check_gke(b: Block, env: dict[str, str]) -> None:
    env = {**env, "REGION": "us-central1", "PROJECT": "my-project"}
    version = importlib.metadata.version("xla-ckpt")
    docker = _dockerfile()
    assert ("ENTRYPOINT", '["xla-ckpt"]') in docker
    workdir = next(v for k, v in docker if k == "WORKDIR")
    copied = {v.split()[-1].removeprefix("./") for k, v in docker if k == "COPY"}
    done = set()
    for line in _commands_raw(b.text):
        words = _shell_words(line)
        commands: list[list[str]] = [[]]
        for w in words:
            if w in ("&&", "|"):
                commands.append([w])
            else:
                commands[-1].append(w)
        for cmd in commands:
            if cmd[0] == "export":
                _exports(cmd, env)
                continue
            cmd = [_subst(w, env) for w in cmd]
            if cmd[0] == "&&":
                cmd = cmd[1:]
            if cmd[:2] == ["docker", "build"]:
                tag = cmd[cmd.index("-t") + 1]
                assert cmd[-1] == "." and tag == env["IMAGE"], cmd
                assert tag.endswith(f"/xla-ckpt:{version}"), f"{b.where}: tag {tag} vs {version}"
                done.add("build")
            elif cmd[:2] == ["docker", "push"]:
                assert cmd[2:] == [env["IMAGE"]], cmd
                done.add("push")
            elif cmd[0] == "sed":
                jobset = _sed(cmd, (ROOT / cmd[-1]).read_text())
            elif cmd[0] == "|":
                assert cmd[1:] == ["kubectl", "apply", "-f", "-"], cmd
                _check_jobset(b, jobset, env, workdir, copied)
                done.add("apply")
            else:
                raise AssertionError(f"{b.where}: unexpected command {cmd}")
    assert done == {"build", "push", "apply"}, f"{b.where}: only {sorted(done)}"


def _commands_raw(text: str) -> list[str]:
    """The block's command lines, backslash continuations joined, comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _sed(cmd: list[str], text: str) -> str:
    """``sed -e 's|old|new|' ...`` applied as sed does (the first match on each line)."""
    for i, w in enumerate(cmd):
        if w == "-e":
            op, old, new, flags = cmd[i + 1].split("|")
            assert (op, flags) == ("s", ""), cmd[i + 1]
            text = "\n".join(ln.replace(old, new, 1) for ln in text.split("\n"))
    return text


def _check_jobset(b: Block, text: str, env: dict[str, str], workdir: str,
                  copied: set[str]) -> None:
    (doc,) = yaml.safe_load_all(text)
    (job,) = doc["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == env["IMAGE"], f"{b.where}: the JobSet runs {container['image']}"
    pod_env = {e["name"]: e["value"] for e in container["env"]}
    assert pod_env.get("XLA_CKPT_BUCKET") == env["XLA_CKPT_BUCKET"], f"{b.where}: {pod_env}"
    args = _cli_args(container["args"])
    rel = Path(args.config).relative_to(workdir)
    assert rel.parts[0] in copied, f"{b.where}: {args.config} is not copied into the image"
    cfg = _config(ROOT / rel, pod_env)
    assert cfg.checkpoint.save_dir.startswith(f"gs://{env['XLA_CKPT_BUCKET']}/")


def check_cuda(b: Block, env: dict[str, str]) -> None:

    (words,) = _commands(b.text)
    assert words[0] == "torchrun" and "-m" in words, words
    module = words[words.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None, f"{b.where}: no module {module}"
    args = _cli_args(words[words.index("-m") + 2:])
    cfg = _config(ROOT / args.config, env)
    assert (args.command, args.device, cfg.dist.backend) == ("train", "cuda", "nccl")


CHECKERS: dict[str, Callable[[Block, dict[str, str]], None]] = {
    "readme-commands": check_readme_commands,
    "tpu-vm": check_tpu_vm,
    "gke": check_gke,
    "cuda": check_cuda,
}


# ---- samples ----------------------------------------------------------------------------------
def sample_ls_output(b: Block, cwd: Path, env: dict[str, str]) -> None:
    real = _run([str(_venv_bin() / "xla-ckpt"), "ls", "run"], cwd, env, b.where).splitlines()
    shown = b.text.splitlines()
    assert real[0].split(": ", 1)[1] == shown[0].split(": ", 1)[1]
    assert real[1].split() == shown[1].split(), f"{b.where}: header {real[1]!r}"
    assert len(real) == len(shown), f"{b.where}: {len(real)} lines, the sample {len(shown)}"
    for got, want in zip(real[2:], shown[2:], strict=True):
        g, w = got.split(), want.split()
        assert g[:7] == w[:7] and g[9:] == w[9:], f"{b.where}: row {got!r} vs {want!r}"


def _demo_strings() -> set[str]:
    out: set[str] = set()
    for p in (ROOT / "xla_ckpt" / "demo").rglob("*.py"):
        out |= {n.value for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


def sample_demo_output(b: Block, _cwd: Path, _env: dict[str, str]) -> None:
    literals = _demo_strings()
    lines = b.text.splitlines()
    headers = [lines[i - 1] for i, ln in enumerate(lines) if i and set(ln) <= {"-", " "} and ln]
    # docs/demo.md: one block with the replicated and FSDP2 legs' tables, one with the local
    # tier leg's.
    assert len(headers) in (1, 2), f"{b.where}: one or two tables, got {len(headers)}"
    for h in headers:
        for col in re.split(r"\s{2,}", h.strip()):
            assert col in literals, f"{b.where}: column {col!r} is not one the demo prints"


def sample_layout(b: Block, cwd: Path, env: dict[str, str]) -> None:
    script = ("import torch\n"
              "from xla_ckpt.manager import CheckpointConfig, CheckpointManager\n"
              "with CheckpointManager(CheckpointConfig(save_dir='layout-run')) as m:\n"
              "    m.save({'w': torch.ones(2)}, epoch=1, num_updates=500, metrics={'loss': 1.0},\n"
              "           rank_state={'rng': torch.zeros(1)})\n")
    _run([sys.executable, "-c", script], cwd, env, b.where)

    run = cwd / "layout-run"
    real = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    state = f"-{STATE_ITEM}.safetensors"
    save_id = next(n for n in real if n.endswith(state)).split("/")[1][len("data-"):-len(state)]
    # A one-process save writes rank 0's own item into the state file; rank 3's file and a
    # sharded saver's chunk file follow the data file rule (item name, "/" written as "-").
    other_ranks = {f"data-<save id>-{item.replace('/', '-')}.safetensors"
                   for item in (rank_item(3), f"{CHUNK_ITEM_PREFIX}00003")}
    shown = [n.removeprefix("gs://bucket/run/").replace("<save_id>", "<save id>")
             for n in re.findall(r"[\w/<>.:-]+\.(?:json|safetensors)\b",
                                 b.text.replace("<save id>", "<save_id>"))]
    for name in shown:
        if name.split("/")[-1] in other_ranks:
            other_ranks.discard(name.split("/")[-1])
            continue
        name = name.replace("<save id>", save_id)
        assert name in real, f"{b.where}: a real save has no {name}: {real}"
    assert not other_ranks, f"{b.where}: the sample lacks {sorted(other_ranks)}"


SAMPLES: dict[str, Callable[[Block, Path, dict[str, str]], None]] = {
    "ls-output": sample_ls_output,
    "demo-output": sample_demo_output,
    "layout": sample_layout,
}


# ---- the tests --------------------------------------------------------------------------------
def _multi_process(page: Path) -> bool:
    return any("torchrun" in b.words for b in blocks_of(page))


@pytest.mark.parametrize("page", [
    pytest.param(p, id=str(p.relative_to(ROOT)),
                 marks=[pytest.mark.slow] if _multi_process(p) else [])
    for p in PAGES if blocks_of(p)])
def test_page_code_blocks_run(page: Path, tmp_path: Path, page_env: dict[str, str],
                              torchrun_zygote: Callable[[], WorkerPool]) -> None:
    cwd = tmp_path / "page"
    scripts = tmp_path / "scripts"
    cwd.mkdir()
    scripts.mkdir()
    for b in blocks_of(page):
        kind = kind_of(b)
        if "needs" in b.opts:
            NEEDS[b.opts["needs"]](cwd)
        if kind == "python":
            run_python(b, cwd, scripts, page_env, torchrun_zygote)
        elif kind == "sh":
            run_sh(b, cwd, page_env)
        elif kind == "yaml":
            check_yaml(b, cwd, page_env)
        elif kind in CHECKERS:
            CHECKERS[kind](b, page_env)
        elif kind in SAMPLES:
            SAMPLES[kind](b, cwd, page_env)
        else:
            raise AssertionError(f"{b.where}: {kind}")


def test_every_block_has_a_known_kind() -> None:
    unknown = [f"{b.where}: {kind_of(b)}" for p in PAGES for b in blocks_of(p)
               if kind_of(b).startswith("unknown")]
    assert not unknown, "\n".join(unknown)
    needs = {b.opts["needs"] for p in PAGES for b in blocks_of(p) if "needs" in b.opts}
    assert needs <= set(NEEDS), f"needs without a fixture: {sorted(needs - set(NEEDS))}"


def test_readme_fits_on_a_screen_and_links_only_to_pages_that_exist() -> None:
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"
