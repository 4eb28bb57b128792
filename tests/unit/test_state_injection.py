"""GlobalState injection: by annotation on any parameter, by first-parameter name, for functors and partials."""

from __future__ import annotations

import functools

from bridge_cli.training.state import GlobalState
from bridge_cli.training.utils.train_utils import (
    maybe_inject_state,
    needs_global_state_injection,
    prepare_forward_step_func,
)


def plain(data_iterator, model): ...
def with_plan(data_iterator, model, return_schedule_plan=False): ...
def by_hint(s: GlobalState, data_iterator, model): ...
def by_name(state, data_iterator, model, return_schedule_plan=False): ...
def by_long_name(global_state, data_iterator, model): ...
def by_string_hint(s: "GlobalState", data_iterator, model): ...


class Functor:
    def __call__(self, state, data_iterator, model):
        return state


def test_detection():
    assert not needs_global_state_injection(plain)
    assert not needs_global_state_injection(with_plan)
    for func in (by_hint, by_name, by_long_name, by_string_hint, Functor()):
        assert needs_global_state_injection(func), func


def test_injection_binds_the_state_once_and_sees_later_changes():
    state = GlobalState(cfg=None)
    wrapped = prepare_forward_step_func(Functor(), state)
    assert isinstance(wrapped, functools.partial) and wrapped("it", "model") is state
    state.train_state.step = 7
    assert wrapped("it", "model").train_state.step == 7
    assert prepare_forward_step_func(plain, state) is plain
    assert not needs_global_state_injection(wrapped)  # wrapping twice injects nothing more
    assert maybe_inject_state(plain, state, needs_injection=True).args == (state,)
