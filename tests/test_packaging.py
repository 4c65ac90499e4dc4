"""The three distributions build as wheels and install into a fresh virtual environment.

``kvboost-rag`` (the core), ``langchain-kvboost`` and ``llama-index-llms-kvboost`` are built from
this repository, installed with pip into a new venv (their own files only), and imported there.
Their third-party dependencies (torch, transformers, langchain-core, llama-index-core, ...) are
reached from the development environment through a path entry added after the install, so the
check runs offline; every declared requirement is checked against what that environment holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {
    "kvboost_rag": ROOT,
    "langchain_kvboost": ROOT / "integrations" / "langchain-kvboost",
    "llama_index_llms_kvboost": ROOT / "integrations" / "llama-index-llms-kvboost",
}

CHECK = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
from langchain_kvboost import ChatKVBoost
from llama_index.llms.kvboost import KVBoost
import kvboost_rag, langchain_kvboost, llama_index.llms.kvboost as li
unmet = []
for dist in ("kvboost-rag", "langchain-kvboost", "llama-index-llms-kvboost"):
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{dist}: {text} (missing)")
            continue
        if not req.specifier.contains(found, prereleases=True):
            unmet.append(f"{dist}: {text} (found {found})")
print(json.dumps({"files": [kvboost_rag.__file__, langchain_kvboost.__file__, li.__file__],
                  "unmet": unmet, "chat": ChatKVBoost().model, "llm": KVBoost().model}))
"""


def source_copy(name: str, into: Path) -> Path:
    """The files a distribution is built from, copied (a build writes build/ and *.egg-info beside them)."""
    source = DISTRIBUTIONS[name]
    target = into / name
    skip = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    if name == "kvboost_rag":
        target.mkdir()
        for file in ("pyproject.toml", "README.md"):
            shutil.copy(source / file, target / file)
        shutil.copytree(source / "kvboost_rag", target / "kvboost_rag", ignore=skip)
    else:
        shutil.copytree(source, target, ignore=skip)
    return target


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    sources, out = tmp_path_factory.mktemp("sources"), tmp_path_factory.mktemp("wheels")
    for name in DISTRIBUTIONS:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                out,
                source_copy(name, sources),
            ],
            check=True,
            cwd=out,
        )
    built = {path.name.split("-")[0]: path for path in out.glob("*.whl")}
    assert set(built) == set(DISTRIBUTIONS), sorted(built)
    return built


def test_each_wheel_holds_its_own_package_only(wheels):
    for name, wheel in wheels.items():
        names = zipfile.ZipFile(wheel).namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
        expected = {"kvboost_rag": {"kvboost_rag"}, "langchain_kvboost": {"langchain_kvboost"}}
        assert tops == expected.get(name, {"llama_index"}), (name, tops)
        if name == "llama_index_llms_kvboost":  # namespace packages stay open for llama-index-core
            assert "llama_index/__init__.py" not in names and "llama_index/llms/__init__.py" not in names
            assert "llama_index/llms/kvboost/__init__.py" in names
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line
            for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        if name == "kvboost_rag":  # compiled at first use on the user's machine
            assert "kvboost_rag/assembler/native_glue.c" in names
        else:
            assert any(line.startswith("Requires-Dist: kvboost-rag") for line in requires), requires


@pytest.mark.slow
def test_the_wheels_install_into_a_fresh_venv_and_import(wheels, tmp_path):
    import json

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            *wheels.values(),
        ],
        check=True,
    )
    fresh_site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # After the install: the development environment's packages, as a plain path entry (its own
    # editable-install hooks are not run, so kvboost's packages come from the fresh venv only).
    (fresh_site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(Path(f).is_relative_to(fresh_site) for f in report["files"]), report["files"]
    assert report["unmet"] == []
    assert report["chat"] == report["llm"] == "smollm2-135m-instruct"
