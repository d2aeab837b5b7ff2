"""The meta-package: every hp-* package installed at the pinned version, the facade's names are
the packages' own objects."""

import importlib.metadata as md
import re
from pathlib import Path

import hyperparallel as hp


def test_pins_are_exact_and_installed():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"(hp-[a-z]+)==([0-9.]+)"', pyproject))
    # every runtime package of the repository (hp-testing is for development only)
    packages = {p.name for p in Path(__file__).parents[3].glob("hp-*")} - {"hp-testing"}
    assert set(pins) == packages
    for dist, version in pins.items():
        assert md.version(dist) == version, dist


def test_facade_names_are_the_packages_objects():
    import hp_dcp
    import hp_dtensor
    import hp_fsdp

    assert hp.fully_shard is hp_fsdp.fully_shard
    assert hp.DTensor is hp_dtensor.DTensor
    assert hp.dcp is hp_dcp and hp.dcp.save is hp_dcp.save
    import hp_kernels

    assert hp.kernels is hp_kernels and hp.kernels.comm.all_reduce is hp_kernels.comm.all_reduce
    import hp_moe

    assert hp.moe is hp_moe and hp.MoE is hp_moe.MoE and hp.ExpertParallel is hp_moe.ExpertParallel
    import hp_autoparallel

    assert hp.autoparallel is hp_autoparallel and hp.autoparallel.search is hp_autoparallel.search
    for name in hp.__all__:
        assert getattr(hp, name) is not None, name
