"""Resolving functions by reference, as a child process does (no processes here)."""

from __future__ import annotations

import functools
import posixpath
import textwrap

import pytest

from hp_testing._fnref import FnRef, resolve


def module_level(x):
    return x + 1


class Holder:
    @staticmethod
    def static(x):
        return x * 2


def test_reference_names_module_qualname_and_file():
    ref = FnRef.of(module_level)
    assert ref.module == __name__
    assert ref.qualname == "module_level"
    assert ref.path is not None and ref.path.endswith("test_fnref.py")
    assert resolve(ref)(1) == 2


def test_static_method_is_resolved_by_dotted_qualname():
    assert resolve(FnRef.of(Holder.static))(3) == 6


def test_resolves_by_import_when_module_is_importable():
    assert resolve(FnRef.of(posixpath.join)) is posixpath.join


@pytest.mark.parametrize(
    "bad",
    [lambda x: x, functools.partial(module_level, 1), len, Holder()],
    ids=["lambda", "partial", "builtin", "instance"],
)
def test_rejects_what_cannot_be_found_by_name(bad):
    with pytest.raises(TypeError, match="module level"):
        FnRef.of(bad)


def test_rejects_nested_function():
    def nested():
        return 1

    with pytest.raises(TypeError, match="<locals>"):
        FnRef.of(nested)


def test_falls_back_to_loading_the_file_when_the_module_is_not_importable(tmp_path):
    src = tmp_path / "loose_test_file.py"
    src.write_text(
        textwrap.dedent(
            """
            FACTOR = 7

            def scaled(x):
                return FACTOR * x
            """
        )
    )
    ref = FnRef(module="tests.not.a.real.package", qualname="scaled", path=str(src))
    fn = resolve(ref)
    assert fn(3) == 21
    assert fn.__module__.startswith("_hp_testing_file_loose_test_file_")
    # a second resolution reuses the loaded module
    assert resolve(ref) is fn


def test_falls_back_to_the_file_when_the_module_name_is_another_file(tmp_path):
    src = tmp_path / "json.py"  # same name as a stdlib module, different file
    src.write_text("def dumps(x):\n    return 'mine'\n")
    fn = resolve(FnRef(module="json", qualname="dumps", path=str(src)))
    assert fn(1) == "mine"


def test_unresolvable_reference_says_what_was_tried(tmp_path):
    ref = FnRef(module="no_such_module_xyz", qualname="f", path=str(tmp_path / "missing.py"))
    with pytest.raises(ImportError) as info:
        resolve(ref)
    text = str(info.value)
    assert "no_such_module_xyz.f" in text
    assert "missing.py" in text
