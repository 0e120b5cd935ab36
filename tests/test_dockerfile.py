"""The Dockerfile (no Docker engine here: checked statically) and the GKE manifest that runs it.

Pins must match pyproject.toml's ``tpu`` extra, the image must install this package with that
extra, run as a non-root user, and have ``xla-ckpt`` as its entrypoint.
"""

import json
import pathlib
import re
import shlex

import tomllib
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBTPU_INDEX = "https://storage.googleapis.com/libtpu-releases/index.html"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; comments dropped, ``\\`` continuations joined."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


DOCKERFILE = instructions((ROOT / "Dockerfile").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pip_installs() -> list[list[str]]:
    """Argument lists of every ``pip install`` in RUN instructions."""
    out = []
    for word, args in DOCKERFILE:
        if word != "RUN":
            continue
        cmds: list[list[str]] = []
        cur: list[str] = []
        for tok in shlex.split(args):
            if tok in ("&&", "||", ";"):
                cmds.append(cur)
                cur = []
            else:
                cur.append(tok)
        cmds.append(cur)
        for toks in cmds:
            if toks[:2] == ["pip", "install"] or toks[:4] == ["python", "-m", "pip", "install"]:
                out.append(toks[toks.index("install") + 1:])
    return out


def requirements(args: list[str]) -> list[str]:
    """Requirement strings among pip arguments (options and their values skipped)."""
    reqs, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-f", "--find-links", "--index-url", "-i", "--extra-index-url"):
            skip = True
            continue
        if not a.startswith("-"):
            reqs.append(a)
    return reqs


def test_base_image_is_python():
    assert DOCKERFILE[0][0] == "FROM"
    assert re.fullmatch(r"python:3\.1[0-3]-slim-\w+", DOCKERFILE[0][1])
    py = PYPROJECT["project"]["requires-python"]
    assert py == ">=3.10"


def test_pins_match_the_tpu_extra():
    tpu = PYPROJECT["project"]["optional-dependencies"]["tpu"]
    assert tpu == ["torch==2.9.0", "torch_xla[tpu]==2.9.0"]
    installed = [r for args in pip_installs() for r in requirements(args)]
    for pin in tpu:
        assert pin in installed, f"{pin} (pyproject tpu extra) is not installed by the Dockerfile"
    # no other version of torch / torch_xla anywhere
    others = [r for r in installed if re.match(r"torch(_xla)?(\[|=|<|>|~|!|$)", r)
              and r not in tpu]
    assert others == []


def test_libtpu_comes_from_googles_index():
    for args in pip_installs():
        if any(r.startswith("torch_xla[tpu]") or ".[tpu" in r for r in requirements(args)):
            links = [args[i + 1] for i, a in enumerate(args) if a in ("-f", "--find-links")]
            assert LIBTPU_INDEX in links, args


def test_this_package_is_installed_with_its_tpu_extra():
    pkg = [r for args in pip_installs() for r in requirements(args) if r.startswith(".[")]
    assert pkg and "tpu" in pkg[0][2:-1].split(","), pkg
    copies = [args for word, args in DOCKERFILE if word == "COPY"]
    assert "pyproject.toml README.md ./" in copies
    assert "xla_ckpt ./xla_ckpt" in copies and "configs ./configs" in copies
    workdirs = [args for word, args in DOCKERFILE if word == "WORKDIR"]
    assert workdirs[0] == "/opt/xla-ckpt"


def test_runs_as_non_root_with_xla_ckpt_entrypoint():
    words = [w for w, _ in DOCKERFILE]
    users = [args for w, args in DOCKERFILE if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert users[-1] == "1000:1000"
    # nothing runs as root after the switch, and the user exists
    assert "RUN" not in words[words.index("USER"):]
    assert any(w == "RUN" and "useradd" in a and "--uid 1000" in a for w, a in DOCKERFILE)
    entry = [args for w, args in DOCKERFILE if w == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["xla-ckpt"]
    assert PYPROJECT["project"]["scripts"]["xla-ckpt"] == "xla_ckpt.cli.main:main"


def test_dockerignore_keeps_the_context_small():
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", "tests", "**/__pycache__"} <= ignored
    assert not ignored & {"xla_ckpt", "configs", "pyproject.toml", "README.md"}


def test_gke_jobset_runs_the_image_on_a_tpu_slice():
    docs = list(yaml.safe_load_all((ROOT / "configs" / "gke" / "jobset.yaml").read_text()))
    assert len(docs) == 1
    js = docs[0]
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "IMAGE"
    # the config it runs is in the repo and where the Dockerfile copies configs/
    assert c["args"][:2] == ["train", "--config"]
    path = c["args"][2]
    assert path.startswith("/opt/xla-ckpt/configs/")
    assert (ROOT / "configs" / path.removeprefix("/opt/xla-ckpt/configs/")).is_file()
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["XLA_CKPT_BUCKET"] == "BUCKET" and env["PJRT_DEVICE"] == "TPU"
    # one pod per TPU host: chips per host x hosts = chips in the topology
    sel = pod["nodeSelector"]
    chips = 1
    for d in sel["cloud.google.com/gke-tpu-topology"].split("x"):
        chips *= int(d)
    assert sel["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert job["parallelism"] == job["completions"] == 2
    assert c["resources"]["limits"]["google.com/tpu"] * job["parallelism"] == chips
    # non-root like the image, and time to save on SIGTERM before SIGKILL
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
