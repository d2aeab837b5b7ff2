"""hp_testing.bad_input in one process: the counting, the per-rank summary and the checks."""

from __future__ import annotations

import pickle
import types

import pytest

from hp_testing.bad_input import Case, by_id, check, count_calls, run_case, type_name


class BaseError(Exception):
    pass


class BadType(BaseError, TypeError):
    pass


class Comm:
    def send(self, x):
        return x

    def recv(self):
        return 0


def _module():
    m = types.ModuleType("fake_dist")
    m.all_reduce = lambda t: t
    m.barrier = lambda: None
    return m


def test_by_id_keeps_order_and_refuses_a_repeated_id():
    a, b = Case("a", print, BadType, "x"), Case("b", print, BadType, "y")
    assert list(by_id([a, b])) == ["a", "b"]
    with pytest.raises(ValueError, match="'a' is given twice"):
        by_id([a, b, a])


def test_count_calls_records_and_restores_on_a_module_and_an_instance():
    m, c = _module(), Comm()
    orig = m.all_reduce
    with count_calls(m, ["all_reduce", "barrier"]) as seen_m, count_calls(c, ["send"]) as seen_c:
        m.barrier()
        m.all_reduce(1)
        assert c.send(3) == 3
    assert seen_m == ["barrier", "all_reduce"] and seen_c == ["send"]
    assert m.all_reduce is orig and "send" not in vars(c)
    with pytest.raises(RuntimeError), count_calls(m, ["barrier"]):
        raise RuntimeError
    assert m.barrier() is None and m.barrier.__name__ == "<lambda>"
    with pytest.raises(AttributeError), count_calls(c, ["recv", "missing"]):
        pass
    assert "recv" not in vars(c)


def _raise_after_barrier(m):
    m.barrier()
    raise BadType("x='a' is a str")


def test_run_case_summarises_a_raise_picklably():
    m = _module()
    r = run_case(_raise_after_barrier, m, count=(m, ["barrier", "all_reduce"]), alive=lambda: 2.0)
    assert pickle.loads(pickle.dumps(r)) == r
    assert r["raised"] == type_name(BadType)
    assert type_name(BaseError) in r["types"] and "builtins.TypeError" in r["types"]
    assert (r["message"], r["collectives"], r["alive"]) == ("x='a' is a str", ["barrier"], 2.0)
    quiet = run_case(lambda: None, alive=None)
    assert quiet["raised"] is None and quiet["collectives"] is None and quiet["alive"] is None


_CASE = Case("f/x_str", _raise_after_barrier, BadType, r"x='a'")


def _summary(counted=("all_reduce",), call=_raise_after_barrier, **changes):
    m = _module()
    return {**run_case(call, m, count=(m, counted), alive=lambda: 2.0), **changes}


def test_check_passes_good_results():
    check(_CASE, [_summary()] * 2, BaseError)
    allowed = Case(_CASE.id, _CASE.call, BadType, _CASE.match, collectives=True)
    check(allowed, [_summary(counted=("barrier",))] * 2, BaseError)
    check(_CASE, [_summary(alive=[3])], BaseError, alive=[3])


@pytest.mark.parametrize(
    "case, results, base, match",
    [
        (_CASE, [_summary(), _summary(message="other")], BaseError, "ranks differ"),
        (_CASE, [_summary(call=lambda m: None)] * 2, BaseError, "no error raised"),
        (Case("f", _CASE.call, ValueError, "x"), [_summary()] * 2, BaseError, "want ValueError"),
        (_CASE, [_summary()] * 2, ValueError, r"want BadType \(a ValueError\)"),
        (_CASE, [_summary(message="y=1")] * 2, BaseError, "!~"),
        (_CASE, [_summary(counted=("barrier",))] * 2, BaseError, r"after collectives \['barrier'"),
        (_CASE, [_summary(alive=1.0)] * 2, BaseError, "alive=1.0, want 2.0"),
    ],
)
def test_check_names_each_failure(case, results, base, match):
    with pytest.raises(AssertionError, match=match):
        check(case, results, base)
