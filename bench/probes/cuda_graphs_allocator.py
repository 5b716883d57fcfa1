"""Probe (GPU): do inductor CUDA graphs (cudagraph trees) work under PyTorch's cudaMallocAsync allocator,
which ComfyUI enables by default? Run:  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 this.py"""
import json
import sys

import torch


def main():
    out = {"allocator": torch.cuda.get_allocator_backend(), "torch": torch.__version__}
    try:
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)

        def f(x):
            return torch.relu(x @ w) * 2

        c = torch.compile(f, options={"triton.cudagraphs": True}, dynamic=False)
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        results = []
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            results.append(c(x).clone())
        torch.cuda.synchronize()
        out["ok"] = all(torch.equal(r, f(x)) for r in results)
        from torch._dynamo.utils import counters

        out["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    except Exception as e:  # the point of the probe is the error message
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    print("PROBE", json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
