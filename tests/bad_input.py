"""The bad-input test every family file has: each case must raise its exception
with a message that names the argument (``match`` is a regex)."""
import pytest


def bad_input_test(cases):
    """A test parametrized over ``cases() -> [(call, exception type, pattern)]``;
    assign it to ``test_bad_input_raises_a_clear_error`` in the family's file."""

    @pytest.mark.parametrize("case", range(len(cases())))
    def test(case):
        fn, exc, pattern = cases()[case]
        with pytest.raises(exc, match=pattern):
            fn()

    return test
