"""An implementation's parameters as the runner binds them (mhctool.registry.impl)."""
import pytest

from mhctool.core.errors import UsageError
from mhctool.registry.impl import Impl, check_callable


def _impl(fn, kernel="h_post_bda"):
    return Impl("f", kernel, "external", fn)


def test_an_optional_input_is_taken_by_name_or_position_and_never_where_a_knob_sits():
    def by_position(h_res, x, h_post, y, b): ...
    def by_name(h_res, x, h_post, y, *, bias=None): ...
    def none(h_res, x, h_post, y): ...
    def knob_there(h_res, x, h_post, y, transpose_res=False): ...
    def anything(h_res, x, h_post, y, **kw): ...
    taken = {f.__name__: _impl(f).takes("bias") for f in (by_position, by_name, none, knob_there, anything)}
    assert taken == {"by_position": True, "by_name": True, "none": False, "knob_there": False, "anything": True}
    assert _impl(none).refuses({"bias": True}).startswith("it takes no bias") and _impl(none).refuses({"bias": False}) is None
    assert _impl(by_position).refuses({"bias": True}) is None
    check_callable(_impl(none))  # callable without the bias
    check_callable(_impl(knob_there))


def test_a_required_input_missing_is_still_refused_with_the_signature():
    def short(h_res, x, h_post): ...
    with pytest.raises(UsageError, match=r"cannot be called as h_post_bda: .*expected h_post_bda\(h_res, x, h_post, y, "
                                         r"bias=None \(optional\)"):
        check_callable(_impl(short))
