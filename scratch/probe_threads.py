import torch, sys
sys.path.insert(0, "tests")
