"""The fixed-shape step's flag: set only inside `static_shapes`, cleared on the way out (also
by an error), and never nested."""

from __future__ import annotations

import pytest

from swaserve.worker.models.static_step import NestedStaticStep, in_static_step, static_shapes


def test_the_flag_holds_inside_the_step_only_and_an_error_clears_it() -> None:
    assert not in_static_step()
    with static_shapes():
        assert in_static_step()
    assert not in_static_step()
    with pytest.raises(ZeroDivisionError), static_shapes():
        _ = 1 / 0
    assert not in_static_step()


def test_a_step_inside_a_step_is_refused_and_leaves_the_outer_one_marked() -> None:
    with static_shapes():
        with pytest.raises(NestedStaticStep), static_shapes():
            pass
        assert in_static_step()
    assert not in_static_step()
