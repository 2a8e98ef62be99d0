import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.metrics import MetricReducer

rows = st.lists(
    st.tuples(st.floats(-1e3, 1e3, allow_nan=False, width=32), st.integers(1, 64)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(rows=rows, fold_every=st.integers(1, 7))
def test_reductions_equal_direct_computation_whatever_the_folding(rows, fold_every):
    r = MetricReducer({"s": "sum", "hi": "max", "lo": "min"}, fold_every=fold_every)
    for v, n in rows:
        t = torch.tensor(v)
        r.update({"m": t, "s": t, "hi": t, "lo": t}, batch_size=n)
    out = r.compute()
    values = [v for v, _ in rows]
    weighted = sum(v * n for v, n in rows) / sum(n for _, n in rows)
    assert math.isclose(out["m"], weighted, rel_tol=1e-4, abs_tol=1e-3)
    assert math.isclose(out["s"], sum(values), rel_tol=1e-4, abs_tol=1e-3)
    assert out["hi"] == max(values) and out["lo"] == min(values)


def test_metrics_missing_from_some_steps_are_weighted_by_their_own_batches():
    r = MetricReducer(fold_every=2)
    r.update({"loss": torch.tensor(1.0)}, batch_size=1)
    r.update({"loss": torch.tensor(3.0), "grad_norm": torch.tensor(5.0)}, batch_size=3)
    r.update({"loss": torch.tensor(2.0)}, batch_size=4)
    assert r.compute() == {"loss": (1 + 9 + 8) / 8, "grad_norm": 5.0}
    r.reset()
    assert r.compute() == {}


def test_a_restored_epoch_folds_with_the_accelerators_rows():
    """A resumed epoch's restored rows are host tensors; the new steps' are on the accelerator
    (here "meta" stands in for it, as this machine has none): folding both is no device mismatch
    (it was, at the first epoch end of a mid-epoch resume on a GPU)."""
    saved = MetricReducer(fold_every=100)
    saved.update({"loss": torch.tensor(2.0)}, 4)
    restored = MetricReducer(fold_every=100)
    restored.load_state_dict(saved.state_dict())
    restored.update({"loss": torch.tensor(1.0, device="meta")}, 4)
    restored._fold()
    assert restored.values["loss"].device.type == "meta" and restored.weights["loss"] == 8
