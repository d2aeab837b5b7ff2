"""Development sessions for the HyperParallel monorepo.

Packages are found by globbing ``packages/*/pyproject.toml``; adding a package needs no edit
here. A dependency whose name is another package of this repository is a *local* dependency and
is installed from its folder in development mode (``pip install -e``), transitively.

    nox -s tests                          # every package, one virtualenv each
    nox -s "tests(pkg='hp-dtensor')"      # one package; extra pytest args after "--"
    nox -s lint                           # ruff + import-linter layering contracts
    nox -s demo                           # torchrun --standalone --nproc_per_node=4 the demo
    nox -s install                        # wheels of every package; pip install hyperparallel
    nox -s tests_mindspore                # hp_dtensor's MindSpore backend (msrun workers)
    nox -s bench                          # every benchmarks/<package>/*.py script

Virtualenvs use pip (virtualenv backend) so that pip's machine configuration (local wheels,
mirrors) applies. torch is always installed first and pinned to the CPU build: a looser
requirement can make pip fetch a multi-GB CUDA build.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import nox
from nox.command import CommandFailed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox runs on 3.11 here
    import tomli as tomllib

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"  # pip, so pip's machine config applies
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "lint"]

ROOT = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"  # the CPU build lies on local disk; never let pip resolve torch freely
TEST_TOOLS = ["pytest", "pytest-timeout"]
LINT_TOOLS = ["ruff==0.17.6", "import-linter==2.17"]  # pinned: new rules must not break CI
PYTEST_TIMEOUT_S = 600  # per test; hp_testing has its own, shorter, per-call timeouts


# --------------------------------------------------------------------------------------------
# Package discovery
# --------------------------------------------------------------------------------------------


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read a project name from requirement {requirement!r}")
    return _normalize(match.group(1))


@dataclass(frozen=True)
class Package:
    name: str  # normalized distribution name, e.g. "hp-dtensor"
    path: Path
    import_names: tuple[str, ...]  # top-level import packages, e.g. ("hp_dtensor",)
    requires: tuple[str, ...]  # [project].dependencies
    test_requires: tuple[str, ...]  # [project.optional-dependencies].test
    build_backend: str

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def _discover() -> dict[str, Package]:
    found: dict[str, Package] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data.get("project", {})
        if "name" not in project:
            continue
        path = pyproject.parent
        name = _normalize(project["name"])
        src = path / "src"
        imports = tuple(
            sorted(p.parent.name for p in src.glob("*/__init__.py")) if src.is_dir() else ()
        ) or (name.replace("-", "_"),)
        found[name] = Package(
            name=name,
            path=path,
            import_names=imports,
            requires=tuple(project.get("dependencies", [])),
            test_requires=tuple(project.get("optional-dependencies", {}).get("test", [])),
            build_backend=data.get("build-system", {}).get("build-backend", ""),
        )
    return found


PACKAGES = _discover()


def _local(requirements: Iterable[str]) -> list[str]:
    return [n for n in (_requirement_name(r) for r in requirements) if n in PACKAGES]


def _external(requirements: Iterable[str]) -> list[str]:
    return [r for r in requirements if _requirement_name(r) not in PACKAGES]


def _with_local_deps(names: Iterable[str]) -> list[str]:
    """``names`` and their local runtime dependencies, transitively; dependencies first."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise ValueError("local dependency cycle: " + " -> ".join((*path, name)))
        for dep in _local(PACKAGES[name].requires):
            visit(dep, (*path, name))
        order.append(name)

    for name in names:
        visit(name, ())
    return order


# --------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------


def _constraints(session: nox.Session) -> list[str]:
    """``-c file`` pinning torch, so no later install can swap in another (CUDA) build."""
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(TORCH + "\n")
    return ["-c", str(path)]


# torch, installed once for every test session (see _share_torch)
SHARED_TORCH = ROOT / ".nox" / "_shared_torch"


def _share_torch(session: nox.Session, pin: list[str]) -> None:
    """Make the pinned torch importable in this session's virtualenv without installing it
    again: it is the same CPU build in every package's session, and installing it took about
    a minute each. It goes once into a shared folder (``pip install --target``), which a
    ``.pth`` file puts on this virtualenv's path; pip then sees it as installed. Everything
    else (numpy, the test tools, the packages and their dependencies) still goes into each
    session's own virtualenv, so a package that leans on an undeclared dependency fails."""
    stamp = SHARED_TORCH / ".hp-installed"
    if not stamp.is_file() or stamp.read_text() != TORCH:
        session.install("--target", str(SHARED_TORCH), "--upgrade", TORCH, *pin)
        stamp.write_text(TORCH)
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    Path(str(purelib).strip(), "_hp_shared_torch.pth").write_text(f"{SHARED_TORCH}\n")


def _install_with_torch(session: nox.Session, packages: list[str], extra: list[str]) -> None:
    """torch first (pinned, shared: :func:`_share_torch`), then numpy and ``extra``, then
    ``-e`` of the local packages."""
    pin = _constraints(session)
    _share_torch(session, pin)
    session.install("numpy", *extra, *pin)  # torch does not install numpy
    editable = [arg for name in packages for arg in ("-e", PACKAGES[name].rel)]
    if editable:
        session.install(*editable, *pin)


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


@nox.session
@nox.parametrize("pkg", sorted(PACKAGES))
def tests(session: nox.Session, pkg: str) -> None:
    """Run one package's tests in its own virtualenv (``nox -s tests`` runs them all)."""
    package = PACKAGES[pkg]
    tests_dir = package.path / "tests"
    if not tests_dir.is_dir():
        session.error(f"{package.rel} has no tests/ folder: every package needs tests")
    local = _with_local_deps([*_local(package.requires), *_local(package.test_requires), pkg])
    _install_with_torch(session, local, [*TEST_TOOLS, *_external(package.test_requires)])
    try:
        session.run(
            "pytest",
            tests_dir.relative_to(ROOT).as_posix(),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--timeout={PYTEST_TIMEOUT_S}",
            *session.posargs,
        )
    except CommandFailed as exc:
        if getattr(exc, "return_code", None) == 5:  # pytest: no tests collected
            session.error(f"pytest collected no tests in {package.rel}/tests: an empty suite fails")
        raise


# Layering (docs/architecture.md). Rows run from top to bottom; a lower row may not import a
# higher one, and packages within a row may not import each other (hp_pipeline reaches hp_fsdp
# only through a protocol it defines itself, so it must not import hp_fsdp). hp_autoparallel
# plans configurations from hp_trainer's model registry and degree checks and hp_pipeline's
# simulator, so it sits above hp_trainer; nothing but the meta-package imports it.
LAYERS: list[list[str]] = [
    ["hyperparallel"],
    ["hp_autoparallel"],
    ["hp_trainer"],
    ["hp_fsdp", "hp_optim", "hp_pipeline", "hp_moe", "hp_offload", "hp_dcp"],
    ["hp_dtensor", "hp_kernels"],
]
FOUNDATIONS = ["hp_dtensor", "hp_kernels"]
DEV_ONLY = "hp_testing"
# External frameworks only the backend binding may import.
BINDING_ONLY = {
    "hp_dtensor": ("hp_dtensor._backend", ["mindspore", "torch_npu"]),
    "hp_fsdp": ("hp_fsdp._backend", ["mindspore"]),
    "hp_offload": ("hp_offload._backend", ["mindspore"]),
    "hp_pipeline": ("hp_pipeline._backend", ["mindspore"]),
}
# The front ends that call each binding: the binding imports none of them, directly or not, so
# no import circle runs through it (bindings sit below the neutral core: they get what they share
# with the front ends, such as hp_dtensor._hooks or hp_fsdp.errors, from modules below both).
BINDING_CALLERS = {
    "hp_dtensor": (
        "hp_dtensor._backend",
        ["hp_dtensor._dtensor", "hp_dtensor._shard_api", "hp_dtensor.parallel"],
    ),
    "hp_fsdp": ("hp_fsdp._backend", ["hp_fsdp._api"]),
    "hp_offload": (
        "hp_offload._backend",
        ["hp_offload._checkpoint", "hp_offload._swap", "hp_offload._plan"],
    ),
    "hp_pipeline": ("hp_pipeline._backend", ["hp_pipeline._stage", "hp_pipeline._runtime"]),
}

# Layers inside a binding (top first): a lower module never imports a higher one, so the
# binding has no import circle of its own.
BINDING_LAYERS = {
    "hp_dtensor": ("hp_dtensor._backend", ["_ms_parallel | _ms_shard", "_ms_ops", "_ms_dtensor"]),
}


def _contract(key: str, name: str, kind: str, **fields: list[str] | str) -> str:
    lines = [f"[importlinter:contract:{key}]", f"name = {name}", f"type = {kind}"]
    for field, value in fields.items():
        if isinstance(value, list):
            lines.append(f"{field} =" + "".join(f"\n    {item}" for item in value))
        else:
            lines.append(f"{field} = {value}")
    return "\n".join(lines)


def importlinter_config(roots: list[str]) -> str:
    """import-linter contracts for the root packages that exist (unknown names break it)."""
    present = set(roots)
    sections = [
        "[importlinter]\nroot_packages ="
        + "".join(f"\n    {r}" for r in sorted(roots))
        + "\ninclude_external_packages = True"
    ]
    rows = [[p for p in row if p in present] for row in LAYERS]
    rows = [row for row in rows if row]
    if len(rows) > 1 or (rows and len(rows[0]) > 1):
        sections.append(
            _contract(
                "layers",
                "Layers: hyperparallel > hp_autoparallel > hp_trainer > feature packages > "
                "foundations",
                "layers",
                layers=[" | ".join(row) for row in rows],
            )
        )
    foundations = [p for p in FOUNDATIONS if p in present]
    others = sorted(present - set(foundations))
    if foundations and (others or len(foundations) > 1):
        sections.append(
            _contract(
                "foundations",
                "Foundations import no other hp_* package (nor each other)",
                "forbidden",
                source_modules=foundations,
                forbidden_modules=sorted(present),
            )
        )
    runtime = sorted(present - {DEV_ONLY})
    if DEV_ONLY in present and runtime:
        sections.append(
            _contract(
                "dev-only",
                f"No runtime package imports {DEV_ONLY}",
                "forbidden",
                source_modules=runtime,
                forbidden_modules=[DEV_ONLY],
            )
        )
        sections.append(
            _contract(
                "dev-only-deps",
                f"{DEV_ONLY} depends on torch only, no other hp_* package",
                "forbidden",
                source_modules=[DEV_ONLY],
                forbidden_modules=runtime,
            )
        )
    for package, (binding, frameworks) in BINDING_ONLY.items():
        if package in present:
            sections.append(
                _contract(
                    f"{package}-binding",
                    f"Only {binding} imports {', '.join(frameworks)}",
                    "forbidden",
                    source_modules=[package],
                    forbidden_modules=frameworks,
                    ignore_imports=[
                        f"{b} -> {fw}" for fw in frameworks for b in (binding, f"{binding}.**")
                    ],
                    unmatched_ignore_imports_alerting="none",
                    # direct imports only: reaching a framework through another package's
                    # binding (hp_fsdp -> hp_dtensor -> hp_dtensor._backend) is that binding's
                    allow_indirect_imports="True",
                )
            )
    for package, (binding, callers) in BINDING_CALLERS.items():
        if package in present:
            sections.append(
                _contract(
                    f"{package}-binding-below",
                    f"{binding} imports none of the front ends that call it",
                    "forbidden",
                    source_modules=[binding],
                    forbidden_modules=callers,
                )
            )
    for package, (binding, layers) in BINDING_LAYERS.items():
        if package in present:
            sections.append(
                _contract(
                    f"{package}-binding-layers",
                    f"{binding}: {' > '.join(layers)} (no circle inside the binding)",
                    "layers",
                    containers=[binding],
                    layers=layers,
                )
            )
    return "\n\n".join(sections) + "\n"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the sources, then import-linter contracts for the layering."""
    session.install(*LINT_TOOLS)
    # Import-scanning needs the packages findable, not their dependencies: no torch here.
    # Compiled packages (non-hatchling backends) are put on PYTHONPATH instead of built.
    pure = [p for p in PACKAGES.values() if p.build_backend.startswith("hatchling")]
    editable = [arg for p in pure for arg in ("-e", p.rel)]
    if editable:
        session.install("--no-deps", *editable)
    compiled = [str(p.path / "src") for p in PACKAGES.values() if p not in pure]
    env = {"PYTHONPATH": os.pathsep.join(compiled)} if compiled else {}

    failed = []
    paths = [p for p in ("packages", "benchmarks", "examples", "noxfile.py") if (ROOT / p).exists()]
    try:
        session.run("ruff", "check", *paths, *session.posargs)
    except CommandFailed:
        failed.append("ruff")

    roots = sorted({name for p in PACKAGES.values() for name in p.import_names})
    layered = {p for row in LAYERS for p in row} | {DEV_ONLY}
    for root in roots:
        if root not in layered:
            session.warn(f"{root} is in no layer: add it to LAYERS in noxfile.py")
    text = importlinter_config(roots)
    if "[importlinter:contract:" not in text:
        session.log("import-linter: no contract applies to the packages present; skipped")
    else:
        config = Path(session.create_tmp()) / "importlinter.ini"
        config.write_text(text)
        session.log(f"import-linter contracts generated in {config}")
        try:
            session.run("lint-imports", str(config), "--no-cache", env=env)
        except CommandFailed:
            failed.append("import-linter")
    if failed:
        session.error("failed: " + ", ".join(failed))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the tiny Llama 3 trained on the embedded corpus on 4 CPU ranks (FSDP 2 x
    TP 2) for 100 steps with a checkpoint, then resumed from it for 20 more steps; prints where
    the logs, checkpoints and loss plot went. ``nox -s demo -- --training.steps 300`` overrides."""
    _install_with_torch(session, _with_local_deps(["hp-trainer"]), [])
    config = "packages/hp-trainer/configs/llama3_tiny_fsdp2_tp2.toml"
    env = {"OMP_NUM_THREADS": "1"}
    out = ROOT / "outputs" / "llama3_tiny_fsdp2_tp2"  # the config's dump folder: start afresh
    if out.exists():
        import shutil

        shutil.rmtree(out)
    session.run(
        "hp-train", "--config", config, "--checkpoint.resume", "false", *session.posargs, env=env
    )
    session.log("resuming from the last checkpoint for 20 more steps")
    steps = 120
    for i, arg in enumerate(session.posargs):  # a --training.steps override moves the target
        if arg == "--training.steps" and i + 1 < len(session.posargs):
            steps = int(session.posargs[i + 1]) + 20
    session.run(
        "hp-train", "--config", config, *session.posargs, "--training.steps", str(steps), env=env
    )


MINDSPORE = ["mindspore==2.10.0", "numpy<2"]  # MindSpore 2.x is built against NumPy 1
# one kernel: MindSpore on NumPy 2 imports, then fails at its first tensor op
MINDSPORE_SMOKE = (
    "import mindspore as ms; ms.set_device('CPU'); "
    "assert (ms.Tensor([1.0, 2.0]) * 2).asnumpy().tolist() == [2.0, 4.0]; "
    "print('MindSpore', ms.__version__, 'works')"
)


@nox.session
def tests_mindspore(session: nox.Session) -> None:
    """hp_dtensor's MindSpore backend: a venv with MindSpore (and torch, which hp_dtensor also
    imports) where the ``tests/mindspore`` folders run, launching ``msrun`` workers. Fails,
    saying why, where MindSpore cannot be installed or does not run: CI must not pass without
    the MindSpore tests."""
    pin = _constraints(session)
    session.install(TORCH, *pin)
    try:
        session.install(*MINDSPORE, *TEST_TOOLS, *pin)
    except CommandFailed:
        session.error(
            f"MindSpore could not be installed ({' '.join(MINDSPORE)}; it needs Python < 3.13, "
            f"this session has {session.python or sys.version.split()[0]}): the MindSpore "
            "tests did not run, so this session fails (pip's output above says why)"
        )
    try:
        session.run("python", "-c", MINDSPORE_SMOKE)
    except CommandFailed:
        session.error(
            f"MindSpore was installed ({' '.join(MINDSPORE)}) but fails to run a tensor op "
            "(output above): the MindSpore tests did not run, so this session fails"
        )
    # hp-testing: the framework-parametrized tests run their torch half on gloo ranks too;
    # hp-fsdp: fully_shard on MindSpore cells; hp-offload: checkpoint and swap on cells;
    # hp-pipeline: schedules over MindSpore stages
    local = _with_local_deps(["hp-dtensor", "hp-fsdp", "hp-offload", "hp-pipeline", "hp-testing"])
    session.install("--no-deps", *[a for n in local for a in ("-e", PACKAGES[n].rel)])
    folders = [
        p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("packages/*/tests/mindspore"))
    ]
    if not folders:
        session.error("no packages/*/tests/mindspore folder: the MindSpore session has no tests")
    session.run(
        "pytest",
        *folders,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--timeout={PYTEST_TIMEOUT_S}",
        *session.posargs,
    )


@nox.session
def install(session: nox.Session) -> None:
    """A user's install, not a developer's: build a wheel of every package, then
    ``pip install hyperparallel`` from those wheels alone (no editable paths, no sources) into a
    fresh virtualenv and use it."""
    wheels = Path(session.create_tmp()) / "wheels"
    if wheels.exists():
        import shutil

        shutil.rmtree(wheels)
    pin = _constraints(session)
    session.install(TORCH, *pin)
    session.install("numpy", "pip", *pin)
    runtime = [p for name, p in sorted(PACKAGES.items()) if name != "hp-testing"]
    session.run("pip", "wheel", "--no-deps", "-q", "-w", str(wheels), *[p.rel for p in runtime])
    session.run("pip", "install", "-q", "--find-links", str(wheels), "hyperparallel", *pin)
    code = (
        "import importlib.metadata as md, hyperparallel as hp, hp_kernels; "
        "assert hp.fully_shard is hp.fsdp.fully_shard; "
        "assert hp_kernels.is_built(), 'hp-kernels wheel lacks its compiled module'; "
        "import hp_trainer.models as m; "
        "assert m.get_config('llama3-tiny').n_layers > 0; "
        "print({d.metadata['Name']: d.version for d in md.distributions() "
        "if d.metadata['Name'].startswith(('hp-', 'hyperparallel'))})"
    )
    session.run("python", "-c", code, env={"PYTHONPATH": ""})
    session.run("hp-train", "--help", silent=True)
    session.run("hp-dcp", "--help", silent=True)


def _has_cuda() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None


@nox.session
def bench(session: nox.Session) -> None:
    """Run every CPU benchmark script, benchmarks/<package>/*.py (files named _* are helpers;
    scripts that set ``REQUIRES_CUDA = True`` run only where CUDA is, and are listed as
    skipped otherwise)."""
    scripts = sorted(p for p in ROOT.glob("benchmarks/*/*.py") if not p.name.startswith("_"))
    cuda_only = [p for p in scripts if "\nREQUIRES_CUDA = True" in p.read_text()]
    if cuda_only and not _has_cuda():
        session.log("CUDA-only, skipped here: " + ", ".join(p.name for p in cuda_only))
        scripts = [p for p in scripts if p not in cuda_only]
    if not scripts:
        session.skip("no benchmarks/<package>/*.py scripts yet")
    _install_with_torch(session, _with_local_deps(sorted(PACKAGES)), [])
    failed = []
    for script in scripts:
        try:
            session.run("python", script.relative_to(ROOT).as_posix(), *session.posargs)
        except CommandFailed:
            failed.append(script.relative_to(ROOT).as_posix())
    if failed:
        session.error("benchmarks failed: " + ", ".join(failed))
