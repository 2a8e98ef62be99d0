import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import rng

ints = st.integers(min_value=0, max_value=2**62)


@given(ints, ints, st.integers(0, 64), st.integers(0, 2))
def test_derived_seed_is_a_pure_function_in_range(seed, step, micro, stream):
    s = rng.derive_seed(seed, step, micro, stream)
    assert s == rng.derive_seed(seed, step, micro, stream)
    assert 0 <= s < 2**63


def test_neighbouring_steps_get_unrelated_seeds():
    seeds = {
        rng.derive_seed(0, step, micro, stream)
        for step in range(200)
        for micro in range(4)
        for stream in range(3)
    }
    assert len(seeds) == 200 * 4 * 3


def test_seeded_restores_the_callers_generator():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with rng.seeded(rng.derive_seed(1, 2)):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)
    with rng.seeded(rng.derive_seed(1, 2)):
        assert torch.equal(torch.rand(4), inside)
