import sys
sys.path.insert(0, "tests")
import torch
from engine import optim
import test_optim_host_counters as t
for name, kw in t.CASES:
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    a = t._device_ops(t._torch_ops(cls, 3, **kw)); b = t._device_ops(t._engine_ops(getattr(optim, name), 3, **kw))
    if a != b:
        print("CASE", name, kw)
        import difflib
        for l in difflib.unified_diff([str(x)[:200] for x in a],[str(x)[:200] for x in b], lineterm="", n=1): print(l)
s = optim.adam().init({"w": torch.zeros(2)})
print(type(s), s)
