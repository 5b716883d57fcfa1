"""How much slower small torch ops run beside a thread running pure Python (the interpreter lock's contention): what
an eager first prompt would pay while a compile traces in a background thread of the same process. CPU only."""
import threading
import time

import torch


def ops(x: torch.Tensor, n: int = 3000) -> float:
    t0 = time.perf_counter()
    y = x
    for _ in range(n):
        y = torch.add(y, 1.0)
    return time.perf_counter() - t0


def main() -> None:
    x = torch.randn(64, 64)
    alone = ops(x)
    stop = threading.Event()

    def busy():
        d = {}
        while not stop.is_set():
            for i in range(1000):
                d[i] = str(i) * 3

    th = threading.Thread(target=busy)
    th.start()
    time.sleep(0.05)
    contended = ops(x)
    stop.set()
    th.join()
    print(f"3000 small torch ops: alone {alone * 1e3:.1f} ms, beside a pure-Python thread {contended * 1e3:.1f} ms "
          f"({contended / alone:.0f}x); per op {alone / 3000 * 1e6:.1f} vs {contended / 3000 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
