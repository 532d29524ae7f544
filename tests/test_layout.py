"""Package layout: import names under ``mrl_plugins.``, no top-level ``adapters``/``hookspecs``, the built
wheel's contents, the TID251 lint ban, the env-gated ``.pth`` start-up hook and lazy heavy imports."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PTH_NAME = "mrl_plugins_autoenable.pth"
SUBPACKAGES = ("device", "rollout", "weight_sync", "comm", "cli", "hookspecs", "adapters", "configs")
TIMEOUT = 120


def _clean_env(**extra: str) -> dict[str, str]:
    """The current environment without PYTHONPATH and the MRL_* switches (plus ``extra``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MRL_")}
    env.update(extra)
    return env


def _python(code: str, *, cwd: Path | str = "/tmp", **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


# --------------------------------------------------------------------------- import names


@pytest.mark.parametrize(
    ("module", "folder"), [("hookspecs", "hookspecs"), ("adapters", "adapters"), ("configs", "configs")]
)
def test_subpackage_lives_in_repo_folder(module, folder):
    """Editable install: the repo's top-level folder itself; wheel install (tox): a copy of it."""
    import mrl_plugins

    spec = importlib.util.find_spec(f"mrl_plugins.{module}")
    assert spec is not None and spec.origin is not None
    origin = Path(spec.origin).resolve()
    source = (REPO_ROOT / folder / "__init__.py").resolve()
    installed = (Path(mrl_plugins.__file__).resolve().parent / module / "__init__.py").resolve()
    assert origin in (source, installed), origin
    assert origin.read_bytes() == source.read_bytes()
    if origin == installed and installed != source:  # a wheel install holds every module of the folder
        names = {p.name for p in (REPO_ROOT / folder).iterdir() if p.suffix in (".py", ".yaml")}
        assert names <= {p.name for p in installed.parent.iterdir()}


def test_hookspecs_importable_by_package_name():
    import mrl_plugins.hookspecs as hs
    from mrl_plugins.hookspecs import spec, types

    assert hs.spec is spec
    assert spec.__name__ == "mrl_plugins.hookspecs.spec" and types.__name__ == "mrl_plugins.hookspecs.types"
    assert "hookspecs" not in sys.modules and "adapters" not in sys.modules


def test_top_level_names_do_not_resolve_to_this_project():
    code = (
        "import importlib.util, json\n"
        "out = {}\n"
        "for name in ('adapters', 'hookspecs', 'configs'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    out[name] = None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))\n"
        "print(json.dumps(out))\n"
    )
    found = json.loads(_python(code, cwd="/tmp"))
    for name, where in found.items():
        assert where is None or str(REPO_ROOT) not in where, f"top-level {name!r} resolves into the repo: {where}"


def test_a_checkout_maps_exactly_the_package_dir_folders():
    """Imported from a checkout with no install to find the mapped subpackages (``-S``: no site-packages, no
    editable finder), ``mrl_plugins.hookspecs/adapters/configs`` are the top-level folders, as ``package-dir``
    maps them, and no other top-level folder (``tests``, ``benchmarks``, ``docs``) becomes ``mrl_plugins.<name>``."""
    code = (
        "import importlib.util, json, mrl_plugins\n"
        "names = ('hookspecs', 'adapters', 'configs', 'tests', 'benchmarks', 'docs')\n"
        "spec = {n: importlib.util.find_spec('mrl_plugins.' + n) for n in names}\n"
        "print(json.dumps({n: s.origin if s else None for n, s in spec.items()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO_ROOT, env=_clean_env(), capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    for name in ("hookspecs", "adapters", "configs"):
        assert found[name] == str(REPO_ROOT / name / "__init__.py"), found
    assert found["tests"] is None and found["benchmarks"] is None and found["docs"] is None, found


# --------------------------------------------------------------------------- wheel


@pytest.mark.slow
def test_wheel_contains_every_package(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(
        ".git",
        "build",
        "dist",
        "tests",
        "__pycache__",
        "*.egg-info",
        ".tox",
        "mrl-out",
        "runs",
        ".*_cache",
        ".hypothesis",
        ".venv",
        ".whl",
    )
    shutil.copytree(REPO_ROOT, src, ignore=ignore)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("mrl_plugins-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        pth = zf.read(PTH_NAME).decode() if PTH_NAME in names else ""
        record = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/RECORD"))
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mrl_plugins/__init__.py" in names
    for sub in SUBPACKAGES:
        assert f"mrl_plugins/{sub}/__init__.py" in names, f"mrl_plugins/{sub} missing from the wheel"
    assert {"mrl_plugins/hookspecs/spec.py", "mrl_plugins/hookspecs/types.py", "mrl_plugins/adapters/trl.py"} <= names
    for yaml_file in (REPO_ROOT / "configs").glob("*.yaml"):
        assert f"mrl_plugins/configs/{yaml_file.name}" in names
    assert "mrl_plugins/py.typed" in names
    assert not any(n.startswith(("adapters/", "hookspecs/", "configs/", "tests/", "benchmarks/")) for n in names)
    assert not any(n.startswith("mrl_plugins/bench") for n in names)  # the lab stays in the repository
    assert PTH_NAME in names and PTH_NAME in record
    assert pth.startswith("import os; os.environ.get('MRL_PLUGINS') and ")
    assert "mrl = mrl_plugins.cli.main:main" in entry_points


# --------------------------------------------------------------------------- lint ban


def _ruff() -> Path:
    ruff = BIN / "ruff"
    if not ruff.exists():
        found = shutil.which("ruff")
        if found is None:
            pytest.skip("ruff is not installed")
        ruff = Path(found)
    return ruff


@pytest.mark.parametrize(
    "source",
    ["import adapters\n", "import hookspecs\n", "from hookspecs import spec\n", "from adapters.trl import enable\n"],
)
def test_ruff_bans_top_level_imports(tmp_path, source):
    path = tmp_path / "user_code.py"
    path.write_text(source + "\n__all__ = []\n")
    proc = subprocess.run(
        [
            str(_ruff()),
            "check",
            "--no-cache",
            "--config",
            str(REPO_ROOT / "pyproject.toml"),
            "--select",
            "TID251",
            path.name,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode != 0
    assert "TID251" in proc.stdout


def test_ruff_allows_package_imports_and_repo_is_clean(tmp_path):
    path = tmp_path / "user_code.py"
    path.write_text("from mrl_plugins.hookspecs import spec\nimport mrl_plugins.adapters\n\n__all__ = ['spec']\n")
    ruff = str(_ruff())
    config = str(REPO_ROOT / "pyproject.toml")
    ok = subprocess.run(
        [ruff, "check", "--no-cache", "--config", config, "--select", "TID251", path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert ok.returncode == 0, ok.stdout
    repo = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "TID251", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert repo.returncode == 0, repo.stdout


# --------------------------------------------------------------------------- start-up hook and lazy imports


def _installed_pth() -> Path:
    import site

    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        if (Path(d) / PTH_NAME).is_file():
            return Path(d) / PTH_NAME
    pytest.fail(f"{PTH_NAME} is not installed in site-packages (pip install -e . / pip install . ships it)")


def test_pth_does_nothing_without_mrl_plugins():
    _installed_pth()
    out = _python("import sys; print('mrl_plugins' in sys.modules, 'yaml' in sys.modules)")
    assert out == "False False"


def test_pth_installs_hook_when_set():
    _installed_pth()
    code = (
        "import sys; "
        "print('mrl_plugins._autoenable' in sys.modules, "
        "any(type(f).__name__ == '_Finder' for f in sys.meta_path), "
        "'trl' in sys.modules, 'torch' in sys.modules)"
    )
    assert _python(code, MRL_PLUGINS="colocate") == "True True False False"


def test_light_imports_do_not_pull_in_host_libraries():
    code = (
        "import sys, json\n"
        "import mrl_plugins, mrl_plugins.hookspecs, mrl_plugins.manager, mrl_plugins.config, mrl_plugins.errors\n"
        "from mrl_plugins.manager import get_plugin_manager\n"
        "heavy = ('torch_npu', 'trl', 'deepspeed', 'vllm', 'ray')\n"
        "after_import = [m for m in heavy if m in sys.modules]\n"
        "get_plugin_manager({'plugins': {'rollout': 'upstream', 'weight_sync': 'upstream', 'comm': 'upstream'}})\n"
        "after_manager = [m for m in heavy if m in sys.modules]\n"
        "print(json.dumps([after_import, after_manager]))\n"
    )
    after_import, after_manager = json.loads(_python(code))
    assert after_import == []
    assert after_manager == []
